/* TurboQuant's MSE stage (kvqbench.quantizers.turboquant.encode / .decode) fused over blocks of R token rows, so
 * that a row is read and written once: encode = unit row, rotation product, nearest centroid; decode = centroid
 * lookup, rotation product, times the norm. The product accumulates every output in k order with one fused
 * multiply-add per term; other summation orders (a BLAS's) differ at fp32 rounding level, so codes agree with the
 * reference except at values within rounding of a threshold (tests/property/test_kernels_turboquant.py). */

#include <math.h>
#include <string.h>

#define R 8          /* token rows per block */
#define C 32         /* output columns per register block */
#define DMAX 512     /* largest head_dim */

/* y[R][C] (columns jb..jb+C of a[R][d] @ m[d][d], m row-major) */
static inline void block_product(const float *restrict a, const float *restrict m, int d, int jb, float y[R][C]) {
  for (int r = 0; r < R; r++)
    for (int j = 0; j < C; j++) y[r][j] = 0.f;
  for (int k = 0; k < d; k++) {
    const float *restrict mk = m + (long)k * d + jb;
    for (int r = 0; r < R; r++) {
      const float ak = a[r * d + k];
      for (int j = 0; j < C; j++) y[r][j] = fmaf(ak, mk[j], y[r][j]);
    }
  }
}

/* the unit row u = (x/p)/‖x/p‖ of one row (p the largest power of two ≤ max|x|; a zero row stays 0); returns
 * ‖x‖ = ‖x/p‖·p and writes max|x| (NaN when the row holds a NaN) */
static float unit_row(const float *restrict x, int d, float *restrict u, float *restrict amax_out) {
  /* d % 32 == 0: 16 running maxima and sums, so the loops vectorize */
  float pmax[16] = {0}, part[16] = {0};
  int nan = 0;
  for (int j0 = 0; j0 < d; j0 += 16)
    for (int i = 0; i < 16; i++) {
      const float v = fabsf(x[j0 + i]);
      nan |= v != v;
      pmax[i] = v > pmax[i] ? v : pmax[i];
    }
  float amax = 0.f;
  for (int i = 0; i < 16; i++) amax = pmax[i] > amax ? pmax[i] : amax;
  *amax_out = nan ? NAN : amax;
  float p = 1.f;
  if (amax != 0.f && isfinite(amax)) {
    int e;
    frexpf(amax, &e);
    p = ldexpf(1.f, e - 1);
  }
  for (int j0 = 0; j0 < d; j0 += 16)
    for (int i = 0; i < 16; i++) {
      const float v = x[j0 + i] / p;
      u[j0 + i] = v;
      part[i] += v * v;
    }
  float ss = 0.f;
  for (int i = 0; i < 16; i++) ss += part[i];
  const float nr = sqrtf(ss);
  const float div = nr > 0.f ? nr : 1.f;
  for (int j = 0; j < d; j++) u[j] /= div;
  return nr * p;
}

/* #{t : thr[t] < y} by binary search over m ascending thresholds (a NaN counts 0) */
static inline unsigned char code_of(float y, const float *restrict thr, int m) {
  int lo = 0, hi = m;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (thr[mid] < y) lo = mid + 1; else hi = mid;
  }
  return (unsigned char)lo;
}

/* codes[n][d] = #{t : thr[t] < (u @ mt)[i][j]} for the unit rows u of x[n][d]; norm[n] = ‖x_i‖, amax[n] = max|x_i|.
 * mt is Πᵀ (d×d, row-major), thr the m ascending thresholds (m ≤ 255). d % C == 0, d ≤ DMAX. */
void tq_encode(const float *restrict x, long n, int d, const float *restrict mt, const float *restrict thr, int m,
               unsigned char *restrict codes, float *restrict norm, float *restrict amax) {
  float u[R * DMAX];
  float y[R][C];
  for (long i0 = 0; i0 < n; i0 += R) {
    const int rows = n - i0 < R ? (int)(n - i0) : R;
    for (int r = 0; r < rows; r++) norm[i0 + r] = unit_row(x + (i0 + r) * d, d, u + r * d, amax + i0 + r);
    if (rows < R) memset(u + rows * d, 0, sizeof(float) * (size_t)(R - rows) * d);
    for (int jb = 0; jb < d; jb += C) {
      block_product(u, mt, d, jb, y);
      for (int r = 0; r < rows; r++) {
        unsigned char *restrict cr = codes + (i0 + r) * d + jb;
        if (m <= 31) {  /* one comparison pass per threshold, vectorized over the columns */
          unsigned char cnt[C] = {0};
          for (int t = 0; t < m; t++) {
            const float th = thr[t];
            for (int j = 0; j < C; j++) cnt[j] += (unsigned char)(y[r][j] > th);
          }
          memcpy(cr, cnt, C);
        } else {
          for (int j = 0; j < C; j++) cr[j] = code_of(y[r][j], thr, m);
        }
      }
    }
  }
}

/* out[n][d] = (table[codes] @ mi)[i] · norm[i]; mi is Π (d×d, row-major), table 256 entries. Returns the largest
 * code (the caller checks it against the codebook's size). d % C == 0, d ≤ DMAX. */
int tq_decode(const unsigned char *restrict codes, long n, int d, const float *restrict mi,
              const float *restrict table, const float *restrict norm, float *restrict out) {
  float a[R * DMAX];
  float y[R][C];
  unsigned char top = 0;
  for (long i0 = 0; i0 < n; i0 += R) {
    const int rows = n - i0 < R ? (int)(n - i0) : R;
    for (int r = 0; r < rows; r++) {
      const unsigned char *restrict cr = codes + (i0 + r) * d;
      for (int j = 0; j < d; j++) {
        a[r * d + j] = table[cr[j]];
        top = cr[j] > top ? cr[j] : top;
      }
    }
    if (rows < R) memset(a + rows * d, 0, sizeof(float) * (size_t)(R - rows) * d);
    for (int jb = 0; jb < d; jb += C) {
      block_product(a, mi, d, jb, y);
      for (int r = 0; r < rows; r++) {
        float *restrict orow = out + (i0 + r) * d + jb;
        const float s = norm[i0 + r];
        for (int j = 0; j < C; j++) orow[j] = y[r][j] * s;
      }
    }
  }
  return top;
}
