/* Dense-and-sparse split of vectors and the nearest-level codes of their dense part, in one pass per vector: the
 * fast version of the reference step dense_sparse.quantize (kvqbench/numerics/dense_sparse.py, KVQuant,
 * arXiv:2401.18079 §3.4; wrapped by kvqbench/kernels/dense_sparse.py).
 *
 * Per vector x of n fp32 values and k outliers per tail (n ≥ 2k + 1):
 *   hi = the (k+1)-th largest value, lo = the (k+1)-th smallest (the dense maximum and minimum);
 *   the outliers are the values > hi and the values < lo, listed by ascending index with their values;
 *   mid = (hi + lo) / 2, half = (hi − lo) / 2, y = clamp((x − mid) / half, −1, 1) (y = 0 where half ≤ 0),
 *   code = #{j : mids[j] < y} for the ascending thresholds mids (the midpoints between levels).
 * Every arithmetic step is one fp32 IEEE operation (compiled with -ffp-contract=off), in the reference's order.
 *
 * The outlier set is unambiguous only when the k-th and (k+1)-th largest (smallest) values differ; where they
 * are equal (ties at a tail's boundary: which index is the outlier depends on the selection algorithm), or where
 * the vector holds a NaN or an infinity, the vector is declined: its flag is set, its outputs are meaningless and
 * the caller runs the reference on it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* elements per step of the code pass: their normalized values and codes stay in registers/L1 */
#define CHUNK 64

/* the m largest of the ascending m values s (m ≥ 1) and v, ascending, in s, without a branch: s[j] becomes
 * min(max(s[j], v), s[j + 1]), so the values below v's place move down one, s[0] drops out, and nothing moves when
 * v ≤ s[0] */
static inline void insert_sorted(float *restrict s, long m, float v) {
  for (long j = 0; j + 1 < m; j++) {
    const float a = s[j] > v ? s[j] : v, b = s[j + 1];
    s[j] = a < b ? a : b;
  }
  s[m - 1] = s[m - 1] > v ? s[m - 1] : v;
}

/* The m largest values of x, ascending, in top, and the m smallest, negated and ascending, in bot (slots no value
 * reached stay −∞: only with a NaN, which the caller declines). x is read as the rows of a matrix of L columns (the
 * last row may be short): one vectorized pass takes each column's maximum and minimum. The m-th largest column
 * maximum t is at most the m-th largest value (the m largest column maxima are m values), so the m largest values
 * are among the values ≥ t, which lie in the columns whose maximum is ≥ t: only those columns are read again (the
 * same for the bottom tail). L ≈ sqrt(m·n) balances the two. col: 2·n floats. */
static void tails(const float *restrict x, long n, long m, float *restrict top, float *restrict bot,
                  float *restrict col) {
  long L = (long)sqrt((double)m * (double)n);
  L = L < 16 ? 16 : (L + 15) / 16 * 16;
  if (L > n) L = n;
  float *cmax = col, *cmin = col + L;
  for (long j = 0; j < L; j++) cmax[j] = cmin[j] = x[j];
  long i = L;
  for (; i + L <= n; i += L)
    for (long j = 0; j < L; j++) {
      const float v = x[i + j];
      cmax[j] = v > cmax[j] ? v : cmax[j];
      cmin[j] = v < cmin[j] ? v : cmin[j];
    }
  for (long j = 0; i + j < n; j++) {
    const float v = x[i + j];
    cmax[j] = v > cmax[j] ? v : cmax[j];
    cmin[j] = v < cmin[j] ? v : cmin[j];
  }
  for (long j = 0; j < m; j++) top[j] = bot[j] = -INFINITY;
  for (long j = 0; j < L; j++) {  /* the m-th largest column maximum, the m-th smallest column minimum */
    insert_sorted(top, m, cmax[j]);
    insert_sorted(bot, m, -cmin[j]);
  }
  const float t_hi = top[0], t_lo = -bot[0];
  for (long j = 0; j < m; j++) top[j] = bot[j] = -INFINITY;
  for (long j = 0; j < L; j++) {
    if (cmax[j] >= t_hi)
      for (long p = j; p < n; p += L)
        if (x[p] >= t_hi && x[p] > top[0]) insert_sorted(top, m, x[p]);
    if (cmin[j] <= t_lo)
      for (long p = j; p < n; p += L)
        if (x[p] <= t_lo && -x[p] > bot[0]) insert_sorted(bot, m, -x[p]);
  }
}

/* one vector; returns 0, or 1 where it is declined (see above) */
static inline __attribute__((always_inline)) int one_vector(
    const float *restrict x, long n, long k, const float *restrict mids, int nm, unsigned char *restrict codes,
    int64_t *restrict idx, float *restrict val, float *restrict lo_out, float *restrict mid_out,
    float *restrict half_out, float *restrict top, float *restrict bot, float *restrict col) {
  const long m = k + 1;
  tails(x, n, m, top, bot, col);
  const float hi = top[0], lo = -bot[0];
  if (top[1] == hi || bot[1] == bot[0]) return 1;  /* a tie at a tail's boundary */
  const float mid = (hi + lo) / 2.f, half = (hi - lo) / 2.f;
  const int live = half > 0.f;
  const float div = live ? half : 1.f;
  long cnt = 0;
  for (long i0 = 0; i0 < n; i0 += CHUNK) {
    const long len = n - i0 < CHUNK ? n - i0 : CHUNK;
    const float *xc = x + i0;
    float y[CHUNK];
    unsigned char q[CHUNK];
    int bad = 0, out = 0;
    for (long t = 0; t < len; t++) {
      const float v = xc[t];
      uint32_t u;
      memcpy(&u, &v, 4);
      bad |= (u & 0x7f800000u) == 0x7f800000u;
      out |= (v > hi) | (v < lo);
      const float r = (v - mid) / div;  /* clamped to [-1, 1]: a dense extreme is exactly ±1 */
      y[t] = r > 1.f ? 1.f : (r < -1.f ? -1.f : r);
      q[t] = 0;
    }
    if (bad) return 1;
    if (!live)
      for (long t = 0; t < len; t++) y[t] = 0.f;
    for (int j = 0; j < nm; j++) {
      const float c = mids[j];
      for (long t = 0; t < len; t++) q[t] += y[t] > c;
    }
    memcpy(codes + i0, q, (size_t)len);
    if (out) {
      for (long t = 0; t < len; t++) {
        const float v = xc[t];
        if (v > hi || v < lo) {
          if (cnt == 2 * k) return 1;
          idx[cnt] = i0 + t;
          val[cnt] = v;
          cnt++;
        }
      }
    }
  }
  if (cnt != 2 * k) return 1;
  *lo_out = lo;
  *mid_out = mid;
  *half_out = half;
  return 0;
}

/* x: nb layers of `rows` contiguous vectors of n fp32 values, layer b at x + b·x_stride; k ≥ 1 outliers per tail
 * (n ≥ 2k + 1); mids: nm ascending thresholds per layer (layer b at mids + b·nm, nm ≤ 255); codes: the uint8
 * codes, layer b at codes + b·codes_stride, vector r at + r·n; idx, val: [nb, rows, 2k] (int64, fp32); lo, mid,
 * half, declined: [nb, rows] (fp32; uint8 set to 1 where the vector is declined); work: 2(k + 1) + 2n floats.
 * Returns the number of declined vectors (see above: the caller runs the reference on them), or −1 for arguments out of scope. */
long ds_quantize(const float *restrict x, long nb, long x_stride, long rows, long n, long k,
                 const float *restrict mids, int nm, unsigned char *restrict codes, long codes_stride,
                 int64_t *restrict idx, float *restrict val, float *restrict lo, float *restrict mid,
                 float *restrict half, unsigned char *restrict declined, float *restrict work) {
  if (k < 1 || n < 2 * k + 1 || nm < 0 || nm > 255) return -1;
  float *top = work, *bot = work + (k + 1), *col = work + 2 * (k + 1);
  long n_declined = 0;
  for (long b = 0; b < nb; b++) {
    for (long r = 0; r < rows; r++) {
      const long v = b * rows + r;
      declined[v] = (unsigned char)one_vector(x + b * x_stride + r * n, n, k, mids + b * nm, nm,
                                              codes + b * codes_stride + r * n, idx + v * 2 * k, val + v * 2 * k,
                                              lo + v, mid + v, half + v, top, bot, col);
      n_declined += declined[v];
    }
  }
  return n_declined;
}
