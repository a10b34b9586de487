/* PolarQuant's per-group steps (kvqbench.quantizers.polarquant.wrap_angle / group_codes / midpoints): atan2's
 * angle folded into [0, 2π); for every matrix of t tokens × p pairs, the min and max of each pair over each group
 * of g consecutive tokens (the last group may be partial), the code clamp(floor((v − min)/s), 0, 2^b − 1) with
 * s = (max − min)/2^b (s = 0 divides by +inf), and back, min + (code + ½)·s. The same fp32 IEEE operations in the
 * reference's order (compiled with -ffp-contract=off: no fused multiply-add), so the results are the reference's
 * bits. */
#include <math.h>

/* phi (n values of atan2) in place: + 2π where negative, then 0 where that reached 2π (two_pi: 2π in fp32) */
void pq_wrap_angle(float *restrict phi, long n, float two_pi) {
  for (long i = 0; i < n; i++) {
    float v = phi[i] < 0.0f ? phi[i] + two_pi : phi[i];
    phi[i] = v >= two_pi ? 0.0f : v;
  }
}

static void extremes_row(const float *restrict row, long p, float *restrict lo, float *restrict hi) {
  for (long j = 0; j < p; j++) {
    lo[j] = row[j] < lo[j] ? row[j] : lo[j];
    hi[j] = row[j] > hi[j] ? row[j] : hi[j];
  }
}

/* clamp(floor(x), 0, top) as trunc(clamp(x, 0, top)): the same integer for every non-NaN x (top is an integer,
 * and truncation is floor from 0 up), in a form the compiler vectorizes */
static void codes_row(const float *restrict row, long p, const float *restrict lo, const float *restrict step,
                      float top, unsigned char *restrict c) {
  for (long j = 0; j < p; j++) {
    float q = (row[j] - lo[j]) / step[j];
    q = q > 0.0f ? q : 0.0f;
    q = q < top ? q : top;
    c[j] = (unsigned char)(int)q;
  }
}

static void midpoints_row(const unsigned char *restrict c, long p, const float *restrict lo,
                          const float *restrict hi, float levels, float *restrict o) {
  for (long j = 0; j < p; j++) {
    const float s = (hi[j] - lo[j]) / levels;
    o[j] = ((float)c[j] + 0.5f) * s + lo[j];
  }
}

/* codes and extremes of n_mat matrices (t × p, row-major) of values v; mn and mx are (n_mat, ⌈t/g⌉, p); step is a
 * work buffer of p floats. Returns 1 (nothing to trust) when a group's minimum or maximum is not finite, else 0. */
int pq_group_codes(const float *restrict v, long n_mat, long t, long p, long g, int bits,
                   unsigned char *restrict codes, float *restrict mn, float *restrict mx, float *restrict step) {
  const long ng = (t + g - 1) / g;
  const float levels = (float)(1 << bits), top = (float)((1 << bits) - 1);
  for (long m = 0; m < n_mat; m++) {
    for (long k = 0; k < ng; k++) {
      const long r0 = k * g, r1 = r0 + g < t ? r0 + g : t;
      float *lo = mn + (m * ng + k) * p, *hi = mx + (m * ng + k) * p;
      for (long j = 0; j < p; j++) lo[j] = hi[j] = v[(m * t + r0) * p + j];
      for (long r = r0 + 1; r < r1; r++) extremes_row(v + (m * t + r) * p, p, lo, hi);
      for (long j = 0; j < p; j++) {
        if (!(isfinite(lo[j]) && isfinite(hi[j]))) return 1;
        const float s = (hi[j] - lo[j]) / levels;
        step[j] = s > 0.0f ? s : INFINITY;
      }
      for (long r = r0; r < r1; r++) codes_row(v + (m * t + r) * p, p, lo, step, top, codes + (m * t + r) * p);
    }
  }
  return 0;
}

/* midpoints of the codes (n_mat, t, p) given mn, mx (n_mat, ⌈t/g⌉, p) → out (n_mat, t, p) */
void pq_midpoints(const unsigned char *restrict codes, long n_mat, long t, long p, long g, int bits,
                  const float *restrict mn, const float *restrict mx, float *restrict out) {
  const long ng = (t + g - 1) / g;
  const float levels = (float)(1 << bits);
  for (long m = 0; m < n_mat; m++)
    for (long r = 0; r < t; r++)
      midpoints_row(codes + (m * t + r) * p, p, mn + (m * ng + r / g) * p, mx + (m * ng + r / g) * p, levels,
                    out + (m * t + r) * p);
}
