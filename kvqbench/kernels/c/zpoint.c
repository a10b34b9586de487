/* Groupwise asymmetric RTN with an integer zero-point (x̂ = scale·(q − z)), fused with the bit packing of its
 * codes, and its decode from the packed bytes: the fast versions of the reference steps zpoint.quantize and
 * zpoint.dequantize (kvqbench/numerics/zpoint.py; wrapped by kvqbench/kernels/zpoint.py), over contiguous fp32
 * rows [rows, d] cut into groups of g consecutive values (g a multiple of 8 that divides d: every group starts at
 * a byte of the packed stream).
 *
 * Per group: lo = min x, hi = max x; with include_zero lo = min(lo, 0), hi = max(hi, 0); lo_c = lo·clip,
 * hi_c = hi·clip; scale = (hi_c − lo_c) / levels; zero = round(−lo_c / scale); a group with scale <= 0
 * (degenerate) gets scale = |lo|, zero = 1 if lo < 0 else 0; codes q = clamp(round(x / s) + zero, 0, levels)
 * with s = scale if scale > 0 else +inf; round = half to even (nearbyintf in the default rounding mode, as
 * torch.round). Each step is one fp32 IEEE operation in the reference's order (-ffp-contract=off); the
 * minimum and maximum are taken in any order (vectorized), so a zero minimum or maximum may carry either
 * sign (the same value).
 *
 * A row holding a NaN or an infinity makes zp_quantize_pack return 1 (its outputs partly written): the caller
 * runs the reference, which reports it.
 *
 * Packing: the LSB-first bit stream of kvqbench.numerics.packing (code i at stream bits [i·b, (i+1)·b), stream
 * bit s = bit s%8 of byte s/8): 8 codes fill b whole bytes (a little-endian word of 8·b bits).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvq_minmax.h"
#include "kvq_pack.h"

/* rows per chunk: the parameters of a chunk's groups are computed first (independent chains that overlap), then
 * its codes, while the chunk is in L1 */
#define CHUNK 16

static inline __attribute__((always_inline)) int quant_rows(const float *restrict x, long rows, long d, long g,
                                                             int include_zero, float clip, int bits,
                                                             float *restrict lo_out, float *restrict hi_out,
                                                             float *restrict scale_out, float *restrict zero_out,
                                                             unsigned char *restrict packed,
                                                             unsigned char *restrict work) {
  const float levels = (float)((1 << bits) - 1);
  const long ng = d / g, row_bytes = d * bits / 8;
  for (long r0 = 0; r0 < rows; r0 += CHUNK) {
    const long r1 = r0 + CHUNK < rows ? r0 + CHUNK : rows;
    for (long i = r0 * ng; i < r1 * ng; i++) {  /* the chunk's groups: parameters */
      float mn, mx;
      kvq_minmax(x + i * g, g, &mn, &mx);
      float lo = mn, hi = mx;
      if (include_zero) {
        lo = lo > 0.f ? 0.f : lo;
        hi = hi < 0.f ? 0.f : hi;
      }
      const float lo_c = lo * clip, hi_c = hi * clip;
      float scale = (hi_c - lo_c) / levels;
      float zero;
      if (scale <= 0.f) {
        scale = fabsf(lo);
        zero = lo < 0.f ? 1.f : 0.f;
      } else {
        zero = nearbyintf(-lo_c / scale);
      }
      lo_out[i] = mn;
      hi_out[i] = mx;
      scale_out[i] = scale;
      zero_out[i] = zero;
    }
    for (long r = r0; r < r1; r++) {  /* codes, packed row by row */
      int bad = 0;
      for (long k = 0; k < ng; k++) {
        const long i = r * ng + k;
        const float *xg = x + i * g;
        const float zero = zero_out[i], s = scale_out[i] > 0.f ? scale_out[i] : INFINITY;
        unsigned char *wg = work + k * g;
        for (long c = 0; c < g; c++) {
          bad |= !(fabsf(xg[c]) <= FLT_MAX);  /* a NaN or an infinity: the row's minima and maxima are meaningless */
          float v = nearbyintf(xg[c] / s) + zero;
          v = v < 0.f ? 0.f : v;
          v = v > levels ? levels : v;
          wg[c] = (unsigned char)(int)v;
        }
      }
      if (bad) return 1;
      kvq_pack_row(work, d, bits, packed + r * row_bytes);
    }
  }
  return 0;
}

/* x [rows, d] fp32 contiguous; lo, hi, scale, zero [rows, d/g]; packed: rows·d·bits/8 bytes; work: d bytes.
 * Returns 0, or 1 (a NaN or an infinity: the caller runs the reference). */
int zp_quantize_pack(const float *restrict x, long rows, long d, long g, int include_zero, float clip, int bits,
                     float *restrict lo, float *restrict hi, float *restrict scale, float *restrict zero,
                     unsigned char *restrict packed, unsigned char *restrict work) {
  KVQ_FOR_WIDTH(bits,
                return quant_rows(x, rows, d, g, include_zero, clip, B, lo, hi, scale, zero, packed, work),
                return 2)
}

static inline __attribute__((always_inline)) void decode_rows(const unsigned char *restrict packed, long rows,
                                                               long d, long g, int bits,
                                                               const float *restrict scale,
                                                               const float *restrict zero, float *restrict out,
                                                               unsigned char *restrict work) {
  const long ng = d / g;
  const unsigned char *p = packed;
  for (long i = 0; i < rows * ng; i++) {  /* group i: g / 8 chunks of 8 codes (bits bytes each) */
    const float z = zero[i], s = scale[i];
    float *og = out + i * g;
    kvq_unpack_row(p, g, bits, work);
    for (long c = 0; c < g; c++) og[c] = ((float)work[c] - z) * s;
    p += g / 8 * bits;
  }
}

/* out [rows, d] = scale · (codes − zero) per group, the codes unpacked from packed (rows·d·bits/8 bytes); work: g
 * bytes.
 * Returns 0, or 2 for a width outside 1..8. */
int zp_decode(const unsigned char *restrict packed, long rows, long d, long g, int bits,
              const float *restrict scale, const float *restrict zero, float *restrict out,
              unsigned char *restrict work) {
  KVQ_FOR_WIDTH(bits, decode_rows(packed, rows, d, g, B, scale, zero, out, work); return 0, return 2)
}
