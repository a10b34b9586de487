/* VarN (KVarN, arXiv:2606.03458 §3 step 2) and the per-row RTN of the balanced tile (step 3), compiled: the
 * fast versions of kvqbench.numerics.varn.varn and .balanced_rtn_rows (registered in kvqbench.kernels.varn).
 * They agree with those references within the tolerance of tests/property/test_kernels_varn.py, not bit for
 * bit: the stds here are one pass over the tile with fp32 sums shifted by the first sample, the balanced tile
 * is never materialized, and the scales are updated in the linear domain — s = clamp(s·clamp(std, 1e-3, 1e3),
 * e^-0.3, e^10), which is exp(clip(log s + log clamp(std), -0.3, 10)) without the exp and log.
 *
 * Tiles are read through strides: element (t, r, c) of the n tiles [R, C] is x[t*st + r*sr + c*sc]; a tile
 * stored transposed (sr = 1, KVarN's K) is read as a plain copy of its transpose. VarN keeps each tile in two
 * local buffers (the tile and its transpose, both in the core's cache), so both axes are summed with unit
 * stride along the vectorized loop: per iteration, with ic = 1/s_col and ir = 1/s_row, the row stds of
 * B = x·ic·ir are ir ⊙ std_cols(x·ic) (one pass over the transpose) and its column stds ic ⊙ std_rows(x·ir)
 * (one pass over the tile). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvq_minmax.h"

#define CHUNK 32

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* copy tile (R x C, strides sr, sc) into dst [R, C] contiguous; returns 1 when a value is not finite */
static int load_tile(const float *restrict src, long sr, long sc, long R, long C, float *restrict dst) {
  if (sc == 1) {
    for (long r = 0; r < R; r++) memcpy(dst + r * C, src + r * sr, (size_t)C * sizeof(float));
  } else if (sr == 1) {
    for (long c0 = 0; c0 < C; c0 += 16) {
      const long c1 = c0 + 16 < C ? c0 + 16 : C;
      for (long r0 = 0; r0 < R; r0 += 16) {
        const long r1 = r0 + 16 < R ? r0 + 16 : R;
        for (long c = c0; c < c1; c++)
          for (long r = r0; r < r1; r++) dst[r * C + c] = src[c * sc + r];
      }
    }
  } else {
    for (long r = 0; r < R; r++)
      for (long c = 0; c < C; c++) dst[r * C + c] = src[r * sr + c * sc];
  }
  int bad = 0;
  for (long i = 0; i < R * C; i++) bad |= !(dst[i] - dst[i] == 0.f);
  return bad;
}

/* dst [C, R] = transpose of src [R, C] (in blocks of 16 x 16) */
static void transpose(const float *restrict src, long R, long C, float *restrict dst) {
  for (long r0 = 0; r0 < R; r0 += 16) {
    const long r1 = r0 + 16 < R ? r0 + 16 : R;
    for (long c0 = 0; c0 < C; c0 += 16) {
      const long c1 = c0 + 16 < C ? c0 + 16 : C;
      for (long c = c0; c < c1; c++)
        for (long r = r0; r < r1; r++) dst[c * R + r] = src[r * C + c];
    }
  }
}

/* out[j] = unbiased std over i < m of a[i·stride + j]·w[i], j < W: one pass with fp32 sums shifted by the first
 * sample (k = a[j]·w[0]), so a large mean cancels only in that subtraction. With W a constant (CHUNK) the sums
 * stay in vector registers. */
static inline __attribute__((always_inline)) void chunk_std(const float *restrict a, const float *restrict w,
                                                            long m, long stride, long W, float *restrict out) {
  float k[CHUNK], s1[CHUNK], s2[CHUNK];
  const float w0 = w[0];
  for (long j = 0; j < W; j++) { k[j] = a[j] * w0; s1[j] = 0.f; s2[j] = 0.f; }
  for (long i = 1; i < m; i++) {
    const float wi = w[i];
    const float *ai = a + i * stride;
    for (long j = 0; j < W; j++) {
      const float z = ai[j] * wi - k[j];
      s1[j] += z;
      s2[j] += z * z;
    }
  }
  const float fm = (float)m, fm1 = (float)(m - 1);
  for (long j = 0; j < W; j++) {
    const float var = (s2[j] - s1[j] * s1[j] / fm) / fm1;
    out[j] = sqrtf(var > 0.f ? var : 0.f);
  }
}

/* out[j] = unbiased std over i < m of a[i, j]·w[i] (a [m, len] contiguous), 1 when m < 2 */
static void axis_std(const float *restrict a, const float *restrict w, long m, long len, float *restrict out) {
  if (m < 2) {
    for (long j = 0; j < len; j++) out[j] = 1.f;
    return;
  }
  long j0 = 0;
  for (; j0 + CHUNK <= len; j0 += CHUNK) chunk_std(a + j0, w, m, len, CHUNK, out + j0);
  for (; j0 < len; j0++) chunk_std(a + j0, w, m, len, 1, out + j0);
}

static inline float ratio(const float *v, long len, float floor_) {
  float mn, mx;
  kvq_minmax(v, len, &mn, &mx);
  return mx / (mn < floor_ ? floor_ : mn);
}

/* VarN on n tiles; writes s_row [n, R], s_col [n, C] (exp of the best iterate's log scales), imb, imb0 [n] and
 * best_iter [n]. Returns 0; 1 when a tile holds a value that is not finite (nothing useful written: the
 * caller runs the reference); -1 when out of memory. */
int varn_tiles(const float *x, long n, long st, long sr, long sc, long R, long C, long n_iter, float lo_std,
               float hi_std, float lo_clip, float hi_clip, float floor_, float *s_row, float *s_col, float *imb,
               float *imb0, long long *best_iter) {
  const long L = R > C ? R : C;
  float *buf = malloc(sizeof(float) * (size_t)(2 * R * C + 16 * L));
  if (!buf) return -1;
  float *xl = buf, *xt = buf + R * C, *v = buf + 2 * R * C;
    float *ec = v + 3 * L, *er = v + 4 * L, *ic = v + 5 * L, *ir = v + 6 * L;
  float *cz = v + 8 * L, *cs = v + 9 * L, *rz = v + 10 * L, *rs = v + 11 * L;
  float *bc = v + 12 * L, *br = v + 13 * L;
  const float lo_s = expf(lo_clip), hi_s = expf(hi_clip); /* the log-scale clip, as a scale clip */
  int status = 0;
  for (long t = 0; t < n && !status; t++) {
    if (sr == 1 && sc != 1) { /* the tile is stored transposed (KVarN's K): its transpose is a plain copy */
      if (load_tile(x + t * st, sc, 1, C, R, xt)) { status = 1; break; }
      transpose(xt, C, R, xl);
    } else {
      if (load_tile(x + t * st, sr, sc, R, C, xl)) { status = 1; break; }
      transpose(xl, R, C, xt);
    }
    for (long c = 0; c < C; c++) { ec[c] = 1.f; ic[c] = 1.f; bc[c] = 1.f; }
    for (long r = 0; r < R; r++) { er[r] = 1.f; ir[r] = 1.f; br[r] = 1.f; }
    axis_std(xl, ir, R, C, cs); /* column stds of x */
    axis_std(xt, ic, C, R, rs); /* row stds of x */
    float best = ratio(cs, C, floor_) + ratio(rs, R, floor_);
    long best_it = 0;
    imb0[t] = best;
    for (long it = 1; it <= n_iter; it++) {
      for (long c = 0; c < C; c++) {
        ec[c] = clampf(ec[c] * clampf(cs[c], lo_std, hi_std), lo_s, hi_s);
        ic[c] = 1.f / ec[c];
      }
      axis_std(xt, ic, C, R, rz); /* row stds of x·ic */
      for (long r = 0; r < R; r++) {
        er[r] = clampf(er[r] * clampf(rz[r] / er[r], lo_std, hi_std), lo_s, hi_s);
        ir[r] = 1.f / er[r];
        rs[r] = rz[r] * ir[r];
      }
      axis_std(xl, ir, R, C, cz); /* column stds of x·ir */
      for (long c = 0; c < C; c++) cs[c] = cz[c] * ic[c];
      const float cur = ratio(cs, C, floor_) + ratio(rs, R, floor_);
      if (cur <= best) { /* ties go to the later iterate */
        best = cur;
        best_it = it;
        memcpy(bc, ec, (size_t)C * sizeof(float));
        memcpy(br, er, (size_t)R * sizeof(float));
      }
    }
    memcpy(s_col + t * C, bc, (size_t)C * sizeof(float));
    memcpy(s_row + t * R, br, (size_t)R * sizeof(float));
    imb[t] = best;
    best_iter[t] = best_it;
  }
  free(buf);
  return status;
}

/* b = x / s_col / s_row (two divisions, in that order), then per row lo = min b, hi = max b,
 * scale = max((hi - lo) / levels, floor), q = clamp(round_half_even((b - lo) / scale), 0, levels) as uint8;
 * q, lo, scale contiguous ([n, R, C], [n, R], [n, R]). Returns 0; 1 when a value of b is not finite; -1 when
 * out of memory. */
/* rows_rtn for a tile stored transposed, xt [C, R] (the rows are its columns): the same operations, each row's
 * values taken across the C lines of xt (vectorized across the rows); codes written to q [R, C]. mn, mx: R
 * floats of work. Returns 1 when a value of b is not finite. */
static int rows_rtn_transposed(float *restrict xt, long R, long C, const float *restrict cs,
                               const float *restrict rs, float levels, float floor_, unsigned char *restrict q,
                               float *restrict lo, float *restrict scale, float *restrict mn, float *restrict mx) {
  int bad = 0;
  for (long c = 0; c < C; c++) {
    float *b = xt + c * R;
    for (long r = 0; r < R; r++) {
      const float v = (b[r] / cs[c]) / rs[r];
      b[r] = v;
      bad |= !(v - v == 0.f);
    }
  }
  if (bad) return 1;
  for (long r = 0; r < R; r++) { mn[r] = xt[r]; mx[r] = xt[r]; }
  for (long c = 1; c < C; c++) {
    const float *b = xt + c * R;
    for (long r = 0; r < R; r++) {
      mn[r] = b[r] < mn[r] ? b[r] : mn[r];
      mx[r] = b[r] > mx[r] ? b[r] : mx[r];
    }
  }
  for (long r = 0; r < R; r++) {
    const float sv = (mx[r] - mn[r]) / levels;
    scale[r] = sv < floor_ ? floor_ : sv;
    lo[r] = mn[r];
  }
  for (long c = 0; c < C; c++) {
    float *b = xt + c * R;
    for (long r = 0; r < R; r++) b[r] = clampf(nearbyintf((b[r] - lo[r]) / scale[r]), 0.f, levels);
  }
  for (long r = 0; r < R; r++)
    for (long c = 0; c < C; c++) q[r * C + c] = (unsigned char)xt[c * R + r];
  return 0;
}

int balanced_rtn_rows(const float *x, long n, long st, long sr, long sc, long R, long C, const float *s_col,
                      const float *s_row, float levels, float floor_, unsigned char *q, float *lo, float *scale) {
  float *xl = malloc(sizeof(float) * (size_t)(R * C + 2 * R));
  if (!xl) return -1;
  int status = 0;
  for (long t = 0; t < n && !status; t++) {
    if (sr == 1 && sc != 1) { /* stored transposed (KVarN's K) */
      load_tile(x + t * st, sc, 1, C, R, xl);
      status = rows_rtn_transposed(xl, R, C, s_col + t * C, s_row + t * R, levels, floor_, q + t * R * C,
                                   lo + t * R, scale + t * R, xl + R * C, xl + R * C + R);
      continue;
    }
    load_tile(x + t * st, sr, sc, R, C, xl);
    const float *cs = s_col + t * C;
    for (long r = 0; r < R && !status; r++) {
      const long row = t * R + r;
      float *b = xl + r * C;
      const float rsc = s_row[row];
      int bad = 0;
      for (long c = 0; c < C; c++) {
        const float v = (b[c] / cs[c]) / rsc;
        b[c] = v;
        bad |= !(v - v == 0.f);
      }
      if (bad) { status = 1; break; }
      float mn, mx;
      kvq_minmax(b, C, &mn, &mx);
      float s = (mx - mn) / levels;
      s = s < floor_ ? floor_ : s;
      unsigned char *qr = q + row * C;
      for (long c = 0; c < C; c++) qr[c] = (unsigned char)clampf(nearbyintf((b[c] - mn) / s), 0.f, levels);
      lo[row] = mn;
      scale[row] = s;
    }
  }
  free(xl);
  return status;
}
