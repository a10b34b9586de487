/* The minimum and maximum of n ≥ 1 fp32 values, taken in any order (the compiler vectorizes the loop): the same
 * values as any ordered scan unless the minimum or maximum is a zero (its sign would depend on the order) or the
 * values hold a NaN, which the callers check for themselves (they then hand the work to their torch code).
 * Shared by the C sources of kvqbench/kernels/c (included; kvqbench.kernels.build hashes it with them). */
#ifndef KVQ_MINMAX_H
#define KVQ_MINMAX_H

__attribute__((optimize("no-signed-zeros", "finite-math-only")))
static inline void kvq_minmax(const float *restrict x, long n, float *mn_out, float *mx_out) {
  float mn = x[0], mx = x[0];
  for (long c = 1; c < n; c++) {
    mn = x[c] < mn ? x[c] : mn;
    mx = x[c] > mx ? x[c] : mx;
  }
  *mn_out = mn;
  *mx_out = mx;
}

#endif
