/* Groupwise asymmetric RTN with an integer zero-point (x̂ = scale·(q − z)), fused with the bit packing of its
 * codes, and its decode from the packed bytes: the elementwise steps that kvqbench.numerics.zpoint exposes,
 * over a block of contiguous fp32 rows [rows, d] cut into groups of g consecutive values (g divides d, d a
 * multiple of 8, so that every row starts at a byte of the packed stream).
 *
 * Every step is one IEEE operation on fp32, in the order of the caller's torch code (compiled with
 * -ffp-contract=off: no fused multiply-add): the caller checks the bits against its torch code once per process
 * before use. Per group: lo = min x, hi = max x (raw, stored); with include_zero lo = min(lo, 0),
 * hi = max(hi, 0); lo_c = lo·clip, hi_c = hi·clip; scale = (hi_c − lo_c) / levels; zero = round(−lo_c / scale);
 * a group with scale <= 0 (degenerate) gets scale = |lo|, zero = 1 if lo < 0 else 0; codes
 * q = clamp(round(x / s) + zero, 0, levels) with s = scale if scale > 0 else +inf; round = half to even
 * (nearbyintf, the default rounding mode, as torch.round).
 *
 * The minimum and maximum are taken in any order (vectorized): that gives the same value unless it is a
 * zero (its sign would depend on the order) or the row holds a non-finite value; then the function
 * returns 1 at once, its outputs partly written (the caller runs its torch code on the whole block).
 *
 * Packing: the LSB-first bit stream of kvqbench.numerics.packing (code i at stream bits [i·b, (i+1)·b), stream
 * bit s = bit s%8 of byte s/8): 8 codes fill b whole bytes (a little-endian word of 8·b bits).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

__attribute__((optimize("no-signed-zeros", "finite-math-only")))
static void group_minmax(const float *restrict x, long g, float *mn_out, float *mx_out) {
  float mn = x[0], mx = x[0];
  for (long c = 1; c < g; c++) {
    mn = x[c] < mn ? x[c] : mn;
    mx = x[c] > mx ? x[c] : mx;
  }
  *mn_out = mn;
  *mx_out = mx;
}

/* 1 when some value of x[0..n) is an infinity or a NaN (its exponent bits all set) */
static int any_nonfinite(const float *restrict x, long n) {
  uint32_t bad = 0;
  for (long c = 0; c < n; c++) {
    uint32_t u;
    memcpy(&u, x + c, 4);
    bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad != 0;
}

static inline __attribute__((always_inline)) void pack_row(const unsigned char *restrict c, long d, int bits,
                                                            unsigned char *restrict out) {
  if (bits == 8) {
    memcpy(out, c, (size_t)d);
    return;
  }
  for (long k = 0; k < d / 8; k++) {
    uint64_t w = 0;
    for (int i = 0; i < 8; i++) w |= (uint64_t)c[8 * k + i] << (i * bits);
    for (int j = 0; j < bits; j++) out[k * bits + j] = (unsigned char)(w >> (8 * j));
  }
}

static inline __attribute__((always_inline)) void unpack_row(const unsigned char *restrict p, long d, int bits,
                                                              float *restrict out) {
  const uint64_t mask = (1u << bits) - 1u;
  for (long k = 0; k < d / 8; k++) {
    uint64_t w = 0;
    for (int j = 0; j < bits; j++) w |= (uint64_t)p[k * bits + j] << (8 * j);
    for (int i = 0; i < 8; i++) out[8 * k + i] = (float)((w >> (i * bits)) & mask);
  }
}

static inline __attribute__((always_inline)) int quant_rows(const float *restrict x, long rows, long d, long g,
                                                             int include_zero, float clip, int bits,
                                                             float *restrict lo_out, float *restrict hi_out,
                                                             float *restrict scale_out, float *restrict zero_out,
                                                             unsigned char *restrict packed,
                                                             unsigned char *restrict work) {
  const float levels = (float)((1 << bits) - 1);
  const long ng = d / g, row_bytes = d * bits / 8;
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * d;
    if (any_nonfinite(xr, d)) return 1;
    for (long k = 0; k < ng; k++) {
      const float *xg = xr + k * g;
      float mn, mx;
      group_minmax(xg, g, &mn, &mx);
      if (mn == 0.f || mx == 0.f) return 1;
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
      const float s = scale > 0.f ? scale : INFINITY;
      unsigned char *wg = work + k * g;
      for (long c = 0; c < g; c++) {
        float v = nearbyintf(xg[c] / s) + zero;
        v = v < 0.f ? 0.f : v;
        v = v > levels ? levels : v;
        wg[c] = (unsigned char)(int)v;
      }
      const long i = r * ng + k;
      lo_out[i] = mn;
      hi_out[i] = mx;
      scale_out[i] = scale;
      zero_out[i] = zero;
    }
    pack_row(work, d, bits, packed + r * row_bytes);
  }
  return 0;
}

/* x [rows, d] fp32 contiguous; lo, hi, scale, zero [rows, d/g]; packed: rows·d·bits/8 bytes; work: d bytes.
 * Returns 0, or 1 (see above: the caller redoes the block). */
int zp_quantize_pack(const float *restrict x, long rows, long d, long g, int include_zero, float clip, int bits,
                     float *restrict lo, float *restrict hi, float *restrict scale, float *restrict zero,
                     unsigned char *restrict packed, unsigned char *restrict work) {
  switch (bits) {  /* a constant width per instance: the packing loops unroll and vectorize */
    case 1: return quant_rows(x, rows, d, g, include_zero, clip, 1, lo, hi, scale, zero, packed, work);
    case 2: return quant_rows(x, rows, d, g, include_zero, clip, 2, lo, hi, scale, zero, packed, work);
    case 3: return quant_rows(x, rows, d, g, include_zero, clip, 3, lo, hi, scale, zero, packed, work);
    case 4: return quant_rows(x, rows, d, g, include_zero, clip, 4, lo, hi, scale, zero, packed, work);
    case 5: return quant_rows(x, rows, d, g, include_zero, clip, 5, lo, hi, scale, zero, packed, work);
    case 6: return quant_rows(x, rows, d, g, include_zero, clip, 6, lo, hi, scale, zero, packed, work);
    case 7: return quant_rows(x, rows, d, g, include_zero, clip, 7, lo, hi, scale, zero, packed, work);
    case 8: return quant_rows(x, rows, d, g, include_zero, clip, 8, lo, hi, scale, zero, packed, work);
    default: return 2;
  }
}

static inline __attribute__((always_inline)) void decode_rows(const unsigned char *restrict packed, long rows,
                                                               long d, long g, int bits,
                                                               const float *restrict scale,
                                                               const float *restrict zero, float *restrict out) {
  const long ng = d / g, row_bytes = d * bits / 8;
  for (long r = 0; r < rows; r++) {
    float *o = out + r * d;
    unpack_row(packed + r * row_bytes, d, bits, o);
    for (long k = 0; k < ng; k++) {
      const float z = zero[r * ng + k], s = scale[r * ng + k];
      float *og = o + k * g;
      for (long c = 0; c < g; c++) og[c] = (og[c] - z) * s;
    }
  }
}

/* out [rows, d] = scale · (codes − zero) per group, the codes unpacked from packed (rows·d·bits/8 bytes).
 * Returns 0, or 2 for a width outside 1..8. */
int zp_decode(const unsigned char *restrict packed, long rows, long d, long g, int bits,
              const float *restrict scale, const float *restrict zero, float *restrict out) {
  switch (bits) {
    case 1: decode_rows(packed, rows, d, g, 1, scale, zero, out); return 0;
    case 2: decode_rows(packed, rows, d, g, 2, scale, zero, out); return 0;
    case 3: decode_rows(packed, rows, d, g, 3, scale, zero, out); return 0;
    case 4: decode_rows(packed, rows, d, g, 4, scale, zero, out); return 0;
    case 5: decode_rows(packed, rows, d, g, 5, scale, zero, out); return 0;
    case 6: decode_rows(packed, rows, d, g, 6, scale, zero, out); return 0;
    case 7: decode_rows(packed, rows, d, g, 7, scale, zero, out); return 0;
    case 8: decode_rows(packed, rows, d, g, 8, scale, zero, out); return 0;
    default: return 2;
  }
}
