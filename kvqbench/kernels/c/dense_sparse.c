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

#include "kvq_minmax.h"

/* elements per step of the code pass: their normalized values and codes stay in registers/L1 */
#define CHUNK 64

/* v placed at p of the min-heap h[0..m) (whose subtrees below p are heaps), moved down to its place */
static inline void sift_down(float *h, long m, long p, float v) {
  for (;;) {
    long c = 2 * p + 1;
    if (c >= m) break;
    if (c + 1 < m && h[c + 1] < h[c]) c++;
    if (!(h[c] < v)) break;
    h[p] = h[c];
    p = c;
  }
  h[p] = v;
}

static inline void replace_root(float *h, long m, float v) { sift_down(h, m, 0, v); }

static void heapify(float *h, long m) {
  for (long p = m / 2 - 1; p >= 0; p--) sift_down(h, m, p, h[p]);
}

/* the (k+1) largest values of x in the min-heap top, the (k+1) smallest negated in the min-heap bot */
static void tails(const float *restrict x, long n, long m, float *restrict top, float *restrict bot) {
  for (long i = 0; i < m; i++) {
    top[i] = x[i];
    bot[i] = -x[i];
  }
  heapify(top, m);
  heapify(bot, m);
  long i = m;
  for (; i + 16 <= n; i += 16) {
    float mn, mx;
    kvq_minmax(x + i, 16, &mn, &mx);
    if (mx > top[0] || -mn > bot[0]) {  /* rare once the heaps hold the tails: a block with a candidate */
      for (long j = i; j < i + 16; j++) {
        if (x[j] > top[0]) replace_root(top, m, x[j]);
        if (-x[j] > bot[0]) replace_root(bot, m, -x[j]);
      }
    }
  }
  for (; i < n; i++) {
    if (x[i] > top[0]) replace_root(top, m, x[i]);
    if (-x[i] > bot[0]) replace_root(bot, m, -x[i]);
  }
}

static inline float second_smallest(const float *h, long m) {  /* of a min-heap with m ≥ 2 entries */
  return m > 2 && h[2] < h[1] ? h[2] : h[1];
}

/* one vector; returns 0, or 1 where it is declined (see above) */
static inline __attribute__((always_inline)) int one_vector(
    const float *restrict x, long n, long k, const float *restrict mids, int nm, unsigned char *restrict codes,
    int64_t *restrict idx, float *restrict val, float *restrict lo_out, float *restrict mid_out,
    float *restrict half_out, float *restrict top, float *restrict bot) {
  const long m = k + 1;
  tails(x, n, m, top, bot);
  const float hi = top[0], lo = -bot[0];
  if (second_smallest(top, m) == hi || second_smallest(bot, m) == bot[0]) return 1;
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
 * half, declined: [nb, rows] (fp32; uint8 set to 1 where the vector is declined); work: 2(k + 1) floats.
 * Returns the number of declined vectors (see above: the caller runs the reference on them), or −1 for arguments out of scope. */
long ds_quantize(const float *restrict x, long nb, long x_stride, long rows, long n, long k,
                 const float *restrict mids, int nm, unsigned char *restrict codes, long codes_stride,
                 int64_t *restrict idx, float *restrict val, float *restrict lo, float *restrict mid,
                 float *restrict half, unsigned char *restrict declined, float *restrict work) {
  if (k < 1 || n < 2 * k + 1 || nm < 0 || nm > 255) return -1;
  float *top = work, *bot = work + (k + 1);
  long n_declined = 0;
  for (long b = 0; b < nb; b++) {
    for (long r = 0; r < rows; r++) {
      const long v = b * rows + r;
      declined[v] = (unsigned char)one_vector(x + b * x_stride + r * n, n, k, mids + b * nm, nm,
                                              codes + b * codes_stride + r * n, idx + v * 2 * k, val + v * 2 * k,
                                              lo + v, mid + v, half + v, top, bot);
      n_declined += declined[v];
    }
  }
  return n_declined;
}
