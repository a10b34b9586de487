/* Asymmetric min/max round-to-nearest with a float zero-point (kvqbench.numerics.rtn), fused with the bit packing
 * of its codes, and its decode from the packed bytes: the fast versions of the steps rtn.quantize_packed and
 * rtn.dequantize_packed (kvqbench.kernels.rtn), over
 * contiguous fp32 rows [rows, d]. Two group layouts:
 *   token:   groups of g consecutive values of a row (g a multiple of 8 dividing d: every group starts at a byte
 *            of the packed stream); g = d is one group per row (per token, or per tensor for a flattened row);
 *   channel: groups of gc consecutive rows of each [t, d] matrix of the rows, one group per column (the last group
 *            of a matrix holds the t % gc rows left, if any; d a multiple of 8).
 * Per group: lo = min x, hi = max x, scale = (hi − lo) / levels (levels = 2^b − 1), codes
 * q = clamp(round((x − lo) / s), 0, levels) with s = scale if scale > 0 else +inf; decode x̂ = q·scale + lo.
 * Every step is one IEEE operation on fp32 in the order of the torch code of kvqbench.numerics.rtn (compiled with
 * -ffp-contract=off: no fused multiply-add); round = half to even (nearbyintf in the default rounding mode, as
 * torch.round). Its agreement with the torch reference is a property test (tests/property/test_kernels_rtn.py).
 *
 * The minimum and maximum are taken in any order (vectorized): that gives the torch value unless it is a zero
 * (then the group is scanned for the signs of its zeros: a group holding both +0 and −0 at its minimum or maximum
 * is declined, since its sign would depend on the order of the comparisons) or the group holds a NaN or an
 * infinity. A call returns 1 (declined: the outputs are partly written and the caller runs the torch code) at a
 * group with mixed-sign zeros at an extreme, an infinite scale (the range overflows fp32), or a NaN or an infinity
 * in a group; 2 for a width outside 1..8; else 0.
 *
 * Packing: kvq_pack.h (the LSB-first stream of kvqbench.numerics.packing; code i of the whole tensor at stream bits
 * [i·b, (i+1)·b)).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvq_minmax.h"
#include "kvq_pack.h"

/* codes per packing piece (a multiple of 8): a piece's codes are written to a work buffer of this many bytes, then
 * packed */
#define PIECE 2048
/* rows per chunk of token groups: the chunk's parameters first (independent chains that overlap), then its codes,
 * while the chunk is in L1 */
#define CHUNK 16

/* the sign of the zero at a group's extreme that is a zero: 0 = all its zeros are +0 (the extreme is +0), 1 = all
 * are −0, -1 = both signs occur (the result of an ordered scan would depend on the order): strided scan of n values
 * that compare equal to the extreme zero */
static int zero_sign(const float *x, long n, long stride) {
  int pos = 0, neg = 0;
  for (long c = 0; c < n; c++) {
    const float v = x[c * stride];
    if (v == 0.f) {
      if (signbit(v)) neg = 1; else pos = 1;
    }
  }
  return pos && neg ? -1 : neg;
}

/* the extreme m of a group (its minimum or maximum, the value an ordered scan gives): a zero takes the sign of the
 * group's zeros; returns 0 where mixed-sign zeros make it order-dependent */
static inline int fix_zero(float *m, const float *x, long n, long stride) {
  if (*m != 0.f) return 1;
  const int s = zero_sign(x, n, stride);
  if (s < 0) return 0;
  *m = s ? -0.f : 0.f;
  return 1;
}

/* codes of n values (one group's lo and scale) into work, clamped to [0, levels]; returns nonzero when a value is a
 * NaN or an infinity (the largest magnitude as an integer: no mask per vector) */
static inline __attribute__((always_inline)) int codes_token(const float *restrict x, long n, float lo, float scale,
                                                             float levels, unsigned char *restrict work) {
  const float s = scale > 0.f ? scale : INFINITY;
  uint32_t mag = 0;  /* the largest magnitude's bits: ≥ those of +inf for a NaN or an infinity */
  for (long c = 0; c < n; c++) {
    uint32_t u;
    memcpy(&u, x + c, 4);
    u &= 0x7fffffffu;
    mag = u > mag ? u : mag;
    float v = nearbyintf((x[c] - lo) / s);
    v = v < 0.f ? 0.f : v;
    v = v > levels ? levels : v;
    work[c] = (unsigned char)(int)v;
  }
  return mag >= 0x7f800000u;
}

static inline __attribute__((always_inline)) int pack_token(const float *restrict x, long rows, long d, long g,
                                                            int bits, float *restrict lo, float *restrict scale,
                                                            unsigned char *restrict packed,
                                                            unsigned char *restrict work) {
  const float levels = (float)((1 << bits) - 1);
  const long ng = d / g;
  for (long r0 = 0; r0 < rows; r0 += CHUNK) {
    const long r1 = r0 + CHUNK < rows ? r0 + CHUNK : rows;
    for (long i = r0 * ng; i < r1 * ng; i++) {  /* the chunk's groups: parameters */
      const float *xg = x + i * g;
      float mn, mx;
      kvq_minmax(xg, g, &mn, &mx);
      if (!fix_zero(&mn, xg, g, 1) || !fix_zero(&mx, xg, g, 1)) return 1;
      const float sc = (mx - mn) / levels;
      if (!(sc <= FLT_MAX)) return 1;  /* an infinite scale (or a NaN in the group) */
      lo[i] = mn;
      scale[i] = sc;
    }
    for (long i = r0 * ng; i < r1 * ng; i++) {  /* codes, packed piece by piece */
      for (long p0 = 0; p0 < g; p0 += PIECE) {
        const long n = g - p0 < PIECE ? g - p0 : PIECE;
        if (codes_token(x + i * g + p0, n, lo[i], scale[i], levels, work)) return 1;
        kvq_pack_row(work, n, bits, packed + (i * g + p0) / 8 * bits);
      }
    }
  }
  return 0;
}

/* x [rows, d] fp32 contiguous in token groups of g; lo, scale: rows·d/g; packed: rows·d·bits/8 bytes; work: PIECE
 * bytes. Returns 0, 1 (declined) or 2 (a width outside 1..8). */
int rtn_pack_token(const float *restrict x, long rows, long d, long g, int bits, float *restrict lo,
                   float *restrict scale, unsigned char *restrict packed, unsigned char *restrict work) {
  KVQ_FOR_WIDTH(bits, return pack_token(x, rows, d, g, B, lo, scale, packed, work), return 2)
}

__attribute__((optimize("no-signed-zeros", "finite-math-only")))
static void column_minmax(const float *restrict x, long gc, long d, float *restrict mn, float *restrict mx) {
  memcpy(mn, x, (size_t)d * sizeof(float));
  memcpy(mx, x, (size_t)d * sizeof(float));
  for (long r = 1; r < gc; r++) {
    const float *xr = x + r * d;
    for (long c = 0; c < d; c++) {
      mn[c] = xr[c] < mn[c] ? xr[c] : mn[c];
      mx[c] = xr[c] > mx[c] ? xr[c] : mx[c];
    }
  }
}

static inline __attribute__((always_inline)) int pack_channel(const float *restrict x, long lead, long t, long d,
                                                              long gc, int bits, float *restrict lo,
                                                              float *restrict scale, unsigned char *restrict packed,
                                                              unsigned char *restrict work, float *restrict tmp) {
  const float levels = (float)((1 << bits) - 1);
  const long row_bytes = d / 8 * bits, ng = (t + gc - 1) / gc;
  for (long j = 0; j < lead * ng; j++) {  /* group j: rows r0 … r0 + n − 1 of its [t, d] matrix */
    const long r0 = (j / ng) * t + (j % ng) * gc, n = (j % ng) * gc + gc <= t ? gc : t - (j % ng) * gc;
    const float *xg = x + r0 * d;
    float *lj = lo + j * d, *sj = scale + j * d;
    column_minmax(xg, n, d, lj, tmp);  /* tmp: the maxima */
    for (long c = 0; c < d; c++) {
      if (!fix_zero(lj + c, xg + c, n, d) || !fix_zero(tmp + c, xg + c, n, d)) return 1;
      const float sc = (tmp[c] - lj[c]) / levels;
      if (!(sc <= FLT_MAX)) return 1;
      sj[c] = sc;
      tmp[c] = sc > 0.f ? sc : INFINITY;  /* the divisor */
    }
    for (long r = 0; r < n; r++) {
      const float *xr = xg + r * d;
      uint32_t mag = 0;
      for (long c = 0; c < d; c++) {
        uint32_t u;
        memcpy(&u, xr + c, 4);
        u &= 0x7fffffffu;
        mag = u > mag ? u : mag;
        float v = nearbyintf((xr[c] - lj[c]) / tmp[c]);
        v = v < 0.f ? 0.f : v;
        v = v > levels ? levels : v;
        work[c] = (unsigned char)(int)v;
      }
      if (mag >= 0x7f800000u) return 1;  /* a NaN or an infinity */
      kvq_pack_row(work, d, bits, packed + (r0 + r) * row_bytes);
    }
  }
  return 0;
}

/* x [lead, t, d] fp32 contiguous in channel groups of gc consecutive rows of each [t, d] matrix (the last group of a
 * matrix holds the t % gc rows left, if any); lo, scale: lead·ceil(t/gc)·d; packed: lead·t·d·bits/8 bytes; work: d
 * bytes; tmp: d floats. Returns 0, 1 (declined) or 2 (a width outside 1..8). */
int rtn_pack_channel(const float *restrict x, long lead, long t, long d, long gc, int bits, float *restrict lo,
                     float *restrict scale, unsigned char *restrict packed, unsigned char *restrict work,
                     float *restrict tmp) {
  KVQ_FOR_WIDTH(bits,
                return pack_channel(x, lead, t, d, gc, B, lo, scale, packed, work, tmp),
                return 2)
}

static inline __attribute__((always_inline)) void decode_token(const unsigned char *restrict packed, long rows,
                                                               long d, long g, int bits, const float *restrict lo,
                                                               const float *restrict scale, float *restrict out,
                                                               unsigned char *restrict work) {
  const long ng = d / g;
  for (long i = 0; i < rows * ng; i++) {
    const float l = lo[i], s = scale[i];
    for (long p0 = 0; p0 < g; p0 += PIECE) {
      const long n = g - p0 < PIECE ? g - p0 : PIECE;
      kvq_unpack_row(packed + (i * g + p0) / 8 * bits, n, bits, work);
      float *o = out + i * g + p0;
      for (long c = 0; c < n; c++) o[c] = (float)work[c] * s + l;
    }
  }
}

/* out [rows, d] = q·scale + lo per token group of g, the codes q unpacked from packed (rows·d·bits/8 bytes); work:
 * PIECE bytes. Returns 0, or 2 for a width outside 1..8. */
int rtn_decode_token(const unsigned char *restrict packed, long rows, long d, long g, int bits,
                     const float *restrict lo, const float *restrict scale, float *restrict out,
                     unsigned char *restrict work) {
  KVQ_FOR_WIDTH(bits,
                decode_token(packed, rows, d, g, B, lo, scale, out, work); return 0,
                return 2)
}

static inline __attribute__((always_inline)) void decode_channel(const unsigned char *restrict packed, long lead,
                                                                 long t, long d, long gc, int bits,
                                                                 const float *restrict lo,
                                                                 const float *restrict scale, float *restrict out,
                                                                 unsigned char *restrict work) {
  const long row_bytes = d / 8 * bits, ng = (t + gc - 1) / gc;
  for (long r = 0; r < lead * t; r++) {
    const long j = (r / t) * ng + (r % t) / gc;
    const float *l = lo + j * d, *s = scale + j * d;
    kvq_unpack_row(packed + r * row_bytes, d, bits, work);
    float *o = out + r * d;
    for (long c = 0; c < d; c++) o[c] = (float)work[c] * s[c] + l[c];
  }
}

/* out [lead, t, d] = q·scale + lo per channel group (rtn_pack_channel's groups; lo, scale: lead·ceil(t/gc)·d), the
 * codes unpacked from packed (lead·t·d·bits/8 bytes); work: d bytes. Returns 0, or 2 for a width outside 1..8. */
int rtn_decode_channel(const unsigned char *restrict packed, long lead, long t, long d, long gc, int bits,
                       const float *restrict lo, const float *restrict scale, float *restrict out,
                       unsigned char *restrict work) {
  KVQ_FOR_WIDTH(bits, decode_channel(packed, lead, t, d, gc, B, lo, scale, out, work); return 0, return 2)
}
