/* Scalar-codebook steps of kvqbench.numerics.lloyd_max: the nearest centroid of every value as the count of
 * thresholds strictly below it (nearest_centroid), and the centroid of every code (reconstruct). Comparisons and
 * table reads only: the results are the reference's exactly. */

#define CHUNK 1024

/* idx[i] = #{j < m : thr[j] < x[i]} for n values (m ≤ 255, thresholds ascending): one comparison pass per
 * threshold over chunks of CHUNK values for small codebooks, a binary search for large ones. A NaN counts 0. */
void lm_count_below(const float *restrict x, long n, const float *restrict thr, int m, unsigned char *restrict idx) {
  if (m <= 31) {
    for (long i0 = 0; i0 < n; i0 += CHUNK) {
      const long len = n - i0 < CHUNK ? n - i0 : CHUNK;
      const float *restrict xc = x + i0;
      unsigned char *restrict ic = idx + i0;
      for (long i = 0; i < len; i++) ic[i] = 0;
      for (int j = 0; j < m; j++) {
        const float t = thr[j];
        for (long i = 0; i < len; i++) ic[i] += (unsigned char)(xc[i] > t);
      }
    }
    return;
  }
  for (long i = 0; i < n; i++) {
    int lo = 0, hi = m;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (thr[mid] < x[i]) lo = mid + 1; else hi = mid;
    }
    idx[i] = (unsigned char)lo;
  }
}

/* out[i] = table[idx[i]] for n codes (table: 256 entries); returns the largest code */
int lm_reconstruct(const float *restrict table, const unsigned char *restrict idx, long n, float *restrict out) {
  unsigned char top = 0;
  for (long i = 0; i < n; i++) {
    out[i] = table[idx[i]];
    top = idx[i] > top ? idx[i] : top;
  }
  return top;
}
