/* VarN's per-iteration sums over a batch of fp32 tiles, in one pass each, with the rounding of torch's CPU
 * batched mat-vecs that kvqbench.numerics.varn uses otherwise (checked at run time, per tile shape, before
 * use: see varn._ckernel_matches). Compiled with -ffp-contract=off: every fused multiply-add is an explicit
 * fmaf, every other product and sum is rounded to fp32 on its own, so the bits do not depend on the ISA.
 *
 * col_sums: s1[t, c] = sum_r w[t, r] x[t, r, c] and s2[t, c] = sum_r (w[t, r]^2) (x[t, r, c]^2), the rows
 *   taken in blocks of 8 in the order of the batched mat-vec torch.matmul(w^T, x) (MKL on x86 with
 *   AVX-512, measured): per block b: acc = fma(w6, x6, acc); acc = fma(w4, x4, acc);
 *   acc += fma(w5, x5, w7 x7); acc += fma(w0, x0, w2 x2) + fma(w1, x1, w3 x3). R must be a multiple of 8.
 * row_sums: s1[t, r] = sum_c x[t, r, c] w[t, c] and s2 alike, the columns in order, one fma per term (the
 *   mat-vec torch.matmul(x, w^T)), read from the transposed tiles xt [n, C, R].
 */
#include <math.h>

#include "kvq_minmax.h"

/* one block of 8 rows of the column sum, in the mat-vec's order (see col_sums above) */
static inline float block8(float a, float w0, float w1, float w2, float w3, float w4, float w5, float w6, float w7,
                           float y0, float y1, float y2, float y3, float y4, float y5, float y6, float y7) {
  a = fmaf(w6, y6, a);
  a = fmaf(w4, y4, a);
  a = a + fmaf(w5, y5, w7 * y7);
  return a + (fmaf(w0, y0, w2 * y2) + fmaf(w1, y1, w3 * y3));
}

#define COL_TERM(k) const float *x##k = xb + (r + k) * C; const float w##k = wt[r + k], v##k = w##k * w##k;

void varn_col_sums(const float *restrict x, const float *restrict w, long n, long R, long C, float *restrict s1, float *restrict s2) {
  for (long t = 0; t < n; t++) {
    float *a1 = s1 + t * C, *a2 = s2 + t * C;
    const float *xb = x + t * R * C, *wt = w + t * R;
    for (long c = 0; c < C; c++) { a1[c] = 0.f; a2[c] = 0.f; }
    for (long r = 0; r < R; r += 8) {
      COL_TERM(0) COL_TERM(1) COL_TERM(2) COL_TERM(3) COL_TERM(4) COL_TERM(5) COL_TERM(6) COL_TERM(7)
      for (long c = 0; c < C; c++) {
        const float y0 = x0[c], y1 = x1[c], y2 = x2[c], y3 = x3[c], y4 = x4[c], y5 = x5[c], y6 = x6[c], y7 = x7[c];
        a1[c] = block8(a1[c], w0, w1, w2, w3, w4, w5, w6, w7, y0, y1, y2, y3, y4, y5, y6, y7);
        a2[c] = block8(a2[c], v0, v1, v2, v3, v4, v5, v6, v7,
                       y0 * y0, y1 * y1, y2 * y2, y3 * y3, y4 * y4, y5 * y5, y6 * y6, y7 * y7);
      }
    }
  }
}

void varn_row_sums(const float *restrict xt, const float *restrict w, long n, long R, long C, float *restrict s1, float *restrict s2) {
  for (long t = 0; t < n; t++) {
    float *a1 = s1 + t * R, *a2 = s2 + t * R;
    const float *xb = xt + t * R * C, *wt = w + t * C;
    for (long r = 0; r < R; r++) { a1[r] = 0.f; a2[r] = 0.f; }
    for (long c = 0; c < C; c++) {
      const float wv = wt[c], w2 = wv * wv;
      const float *xc = xb + c * R;
      for (long r = 0; r < R; r++) {
        const float v = xc[r];
        a1[r] = fmaf(v, wv, a1[r]);
        a2[r] = fmaf(v * v, w2, a2[r]);
      }
    }
  }
}

/* ---- one VarN half-iteration per call (the glue between torch's exp, log and sqrt, which stay in torch:
 * its vectorized versions are not the correctly rounded functions of a C library) ----------------------
 * Every operation is the elementwise IEEE operation of the torch code it replaces, in the same order
 * (division, product, difference, comparisons), so results are bit for bit those of varn._varn_chunk's
 * torch path (tested). Sums: the two kernels above. Unbiased one-pass variance over m samples:
 * mean2 = (s1/m)^2, var = max((s2 - (s1*s1)/m)/(m - 1), 0) (the caller takes the square root); a value is
 * flagged (two-pass fallback, done by the caller) when mean2 > var*cancel. bad[t] = 1 when any value of
 * tile t is flagged; the return value is 1 when any tile is. work: max(R, C) floats. */

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline int var_from_sums(float *s1, const float *s2, long len, long m, float cancel) {
  /* s1 <- variance (in place); returns whether any value is flagged */
  const float fm = (float)m, fm1 = (float)(m - 1);
  int flagged = 0;
  for (long i = 0; i < len; i++) {
    const float a = s1[i];
    float mean2 = a / fm;
    mean2 = mean2 * mean2;
    float var = s2[i] - (a * a) / fm;
    var = var / fm1;
    var = var < 0.f ? 0.f : var;
    flagged |= mean2 > var * cancel;
    s1[i] = var;
  }
  return flagged;
}

/* e_col = exp(log_col) [n, C]: ic = 1/e_col; rz = row variances of x*ic (over C columns), from xt [n, C, R] */
int varn_row_half(const float *restrict xt, const float *restrict e_col, long n, long R, long C, float cancel,
                  float *restrict ic, float *restrict rz, unsigned char *restrict bad, float *restrict work) {
  int any = 0;
  float *s2 = work;
  for (long t = 0; t < n; t++) {
    float *ict = ic + t * C, *rzt = rz + t * R;
    const float *ec = e_col + t * C;
    for (long c = 0; c < C; c++) ict[c] = 1.0f / ec[c];
    varn_row_sums(xt + t * R * C, ict, 1, R, C, rzt, s2);
    const int f = var_from_sums(rzt, s2, R, C, cancel);
    bad[t] = (unsigned char)f;
    any |= f;
  }
  return any;
}

/* e_row = exp(log_row) [n, R], rz [n, R] (row stds): ir = 1/e_row; rs = rz*ir; csd = column variances of x*ir
 * (over R rows),
 * from x [n, R, C] (R a multiple of 8) */
int varn_col_half(const float *restrict x, const float *restrict e_row, const float *restrict rz,
                  long n, long R, long C, float cancel,
                  float *restrict ir, float *restrict rs, float *restrict csd, unsigned char *restrict bad,
                  float *restrict work) {
  int any = 0;
  float *s2 = work;
  for (long t = 0; t < n; t++) {
    float *irt = ir + t * R, *rst = rs + t * R, *cst = csd + t * C;
    const float *er = e_row + t * R, *rzt = rz + t * R;
    for (long r = 0; r < R; r++) { irt[r] = 1.0f / er[r]; rst[r] = rzt[r] * irt[r]; }
    varn_col_sums(x + t * R * C, irt, 1, R, C, cst, s2);
    const int f = var_from_sums(cst, s2, C, R, cancel);
    bad[t] = (unsigned char)f;
    any |= f;
  }
  return any;
}

/* cs (the column stds) = cs*ic; imbalance = max(cs)/max(min(cs), floor) + max(rs)/max(min(rs), floor); where imbalance <=
 * best_imb: best_imb, best_col (<- log_col), best_row (<- log_row), best_iter (<- it) take the new state;
 * cs <- clamp(cs, lo_std, hi_std) (what the next iteration takes the log of) */
void varn_track(long n, long R, long C, float floor_, float lo_std, float hi_std, long it,
                float *restrict cs, const float *restrict ic, const float *restrict rs,
                const float *restrict log_col, const float *restrict log_row,
                float *restrict best_imb, float *restrict best_col, float *restrict best_row,
                long long *restrict best_iter) {
  for (long t = 0; t < n; t++) {
    float *cst = cs + t * C;
    const float *ict = ic + t * C, *rst = rs + t * R;
    float cmax = -INFINITY, cmin = INFINITY, rmax = -INFINITY, rmin = INFINITY;
    int nan = 0;
    for (long c = 0; c < C; c++) {
      const float v = cst[c] * ict[c];
      cst[c] = v;
      nan |= v != v;
      cmax = v > cmax ? v : cmax;
      cmin = v < cmin ? v : cmin;
    }
    for (long r = 0; r < R; r++) {
      const float v = rst[r];
      nan |= v != v;
      rmax = v > rmax ? v : rmax;
      rmin = v < rmin ? v : rmin;
    }
    float cur = cmax / (cmin < floor_ ? floor_ : cmin) + rmax / (rmin < floor_ ? floor_ : rmin);
    if (nan) cur = NAN;
    if (cur <= best_imb[t]) {
      best_imb[t] = cur;
      for (long c = 0; c < C; c++) best_col[t * C + c] = log_col[t * C + c];
      for (long r = 0; r < R; r++) best_row[t * R + r] = log_row[t * R + r];
      best_iter[t] = it;
    }
    for (long c = 0; c < C; c++) cst[c] = clampf(cst[c], lo_std, hi_std);
  }
}

/* dst[t, c, r] = src[t, r, c] for n tiles [R, C] (a copy: exact), in blocks of 16 x 16 */
void varn_transpose(const float *restrict src, long n, long R, long C, float *restrict dst) {
  for (long t = 0; t < n; t++) {
    const float *s = src + t * R * C;
    float *d = dst + t * R * C;
    for (long r0 = 0; r0 < R; r0 += 16) {
      const long r1 = r0 + 16 < R ? r0 + 16 : R;
      for (long c0 = 0; c0 < C; c0 += 16) {
        const long c1 = c0 + 16 < C ? c0 + 16 : C;
        for (long c = c0; c < c1; c++)
          for (long r = r0; r < r1; r++) d[c * R + r] = s[r * C + c];
      }
    }
  }
}

/* ---- all iterations in one call, torch's exp/log/sqrt included --------------------------------------------
 * On the CPU torch computes fp32 exp, log and sqrt with MKL's vector math (vmsExp, vmsLn, vmsSqrt, high
 * accuracy, denormals kept, errors ignored): the caller passes those functions (their Fortran entry points,
 * all arguments by reference) and `mode`, after checking their bits against torch's on random data, and this
 * runs VarN's iterations with exactly the operations of varn._c_iterations. Iterations it0..n_iter from
 * phase p0 (0: start of an iteration, 1: after the row stds, 2: after the column stds); returns -1 when done,
 * else 3*it + phase where it stopped because a half-step flagged a tile for the two-pass fallback (bad[]):
 * the caller replaces the flagged stds (rz at phase 1, csd at phase 2) and calls again from there. */
typedef void (*vml_fn)(const long long *n, const float *a, float *y, const long long *mode);

static inline void clamp_add(float *restrict dst, const float *restrict add, long len, float lo, float hi) {
  for (long i = 0; i < len; i++) dst[i] = clampf(dst[i] + add[i], lo, hi);
}

long varn_iterate(const float *restrict x, const float *restrict xt, long n, long R, long C, long it0, long p0,
                  long n_iter, float lo_std, float hi_std, float lo_clip, float hi_clip, float cancel, float floor_,
                  vml_fn vexp, vml_fn vln, vml_fn vsqrt, long long mode,
                  float *log_col, float *log_row, float *e_col, float *e_row, float *ic, float *rz, float *rsb,
                  float *ir, float *rs, float *csd, unsigned char *bad, float *work,
                  float *best_imb, float *best_col, float *best_row, long long *best_iter) {
  const long long nc = n * C, nr = n * R;
  long p = p0;
  for (long it = it0; it <= n_iter; it++, p = 0) {
    if (p == 0) {
      vln(&nc, csd, csd, &mode);                     /* cs.log_() (csd holds the clamped column stds) */
      clamp_add(log_col, csd, nc, lo_clip, hi_clip); /* log_col.add_(…).clamp_(lo_clip, hi_clip) */
      vexp(&nc, log_col, e_col, &mode);
      const int f = varn_row_half(xt, e_col, n, R, C, cancel, ic, rz, bad, work);
      vsqrt(&nr, rz, rz, &mode);
      if (f) return 3 * it + 1;
      p = 1;
    }
    if (p == 1) {
      for (long i = 0; i < nr; i++) rsb[i] = clampf(rz[i] / e_row[i], lo_std, hi_std);
      vln(&nr, rsb, rsb, &mode);
      clamp_add(log_row, rsb, nr, lo_clip, hi_clip);
      vexp(&nr, log_row, e_row, &mode);
      const int f = varn_col_half(x, e_row, rz, n, R, C, cancel, ir, rs, csd, bad, work);
      vsqrt(&nc, csd, csd, &mode);
      if (f) return 3 * it + 2;
      p = 2;
    }
    varn_track(n, R, C, floor_, lo_std, hi_std, it, csd, ic, rs, log_col, log_row, best_imb, best_col, best_row,
               best_iter);
  }
  return -1;
}

/* ---- balance by column and row scales, then asymmetric RTN per row, in one pass per row (KVarN steps 2-3) -------
 * b = tiles / s_col / s_row (two divisions, in that order; into work, tiles untouched); per row lo = min b,
 * hi = max b, scale = max((hi - lo) / levels, floor); q = clamp(round_half_even((b - lo) / scale), 0, levels)
 * as uint8. The operations and their order are torch's (the caller checks the bits once per process). The
 * min and max are taken in any order (vectorized), which gives the same value unless the row holds a zero
 * (the sign of a zero minimum would depend on the order) or a non-finite value: then the function returns 1
 * at once (the caller runs its torch code on the untouched tiles); else 0. work: C floats. */

int balanced_rtn_rows(const float *restrict tiles, const float *restrict s_col, const float *restrict s_row,
                      long n, long R, long C, float levels, float floor_, unsigned char *restrict q,
                      float *restrict lo, float *restrict scale, float *restrict work) {
  for (long t = 0; t < n; t++) {
    const float *sc = s_col + t * C;
    for (long r = 0; r < R; r++) {
      const long row = t * R + r;
      const float *x = tiles + row * C;
      unsigned char *qr = q + row * C;
      const float sr = s_row[row];
      int odd = 0;
      for (long c = 0; c < C; c++) {
        const float v = (x[c] / sc[c]) / sr;
        work[c] = v;
        odd |= (v == 0.f) | !(v - v == 0.f); /* a zero, an infinity or a NaN */
      }
      if (odd) return 1;
      float mn, mx;
      kvq_minmax(work, C, &mn, &mx);
      float s = (mx - mn) / levels;
      s = s < floor_ ? floor_ : s;
      for (long c = 0; c < C; c++) {
        const float v = nearbyintf((work[c] - mn) / s);
        qr[c] = (unsigned char)clampf(v, 0.f, levels);
      }
      lo[row] = mn;
      scale[row] = s;
    }
  }
  return 0;
}
