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
        float a = a1[c];
        a = fmaf(w6, y6, a);
        a = fmaf(w4, y4, a);
        a = a + fmaf(w5, y5, w7 * y7);
        a = a + (fmaf(w0, y0, w2 * y2) + fmaf(w1, y1, w3 * y3));
        a1[c] = a;
        const float q0 = y0 * y0, q1 = y1 * y1, q2 = y2 * y2, q3 = y3 * y3;
        const float q4 = y4 * y4, q5 = y5 * y5, q6 = y6 * y6, q7 = y7 * y7;
        float b = a2[c];
        b = fmaf(v6, q6, b);
        b = fmaf(v4, q4, b);
        b = b + fmaf(v5, q5, v7 * q7);
        b = b + (fmaf(v0, q0, v2 * q2) + fmaf(v1, q1, v3 * q3));
        a2[c] = b;
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
