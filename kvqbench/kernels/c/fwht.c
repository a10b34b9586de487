/* The normalized Walsh–Hadamard transform of rows by butterflies (the fast Walsh–Hadamard transform): the fast
 * version of kvqbench.numerics.hadamard.fwht (registered in kvqbench.kernels.hadamard), whose torch code fixes
 * the operations and their order: per block of n (a power of two) consecutive values of a row, the stages
 * h = 1, 2, 4, …, n/2 in that order, each replacing every pair (y[j], y[j + h]) of a run of 2h values by
 * (y[j] + y[j + h], y[j] − y[j + h]); then every value times the block's scale (1/√n rounded to fp32). Each step
 * is one fp32 IEEE operation (compiled with -ffp-contract=off); a NaN in the result is written as the canonical
 * quiet NaN 0x7fc00000. Agreement with the reference: tests/property/test_kernels_hadamard.py.
 */
#include <stdint.h>
#include <string.h>

static inline void stage(float *restrict y, long n, long h) {
  for (long i = 0; i < n; i += 2 * h)
    for (long j = i; j < i + h; j++) {
      const float a = y[j], b = y[j + h];
      y[j] = a + b;
      y[j + h] = a - b;
    }
}

/* the first stages with a constant pair distance: the compiler vectorizes them across the runs */
#define SMALL_STAGE(H)                                                   \
  static inline void stage##H(float *restrict y, long n) {               \
    for (long i = 0; i < n; i += 2 * (H))                                \
      for (long j = 0; j < (H); j++) {                                   \
        const float a = y[i + j], b = y[i + j + (H)];                    \
        y[i + j] = a + b;                                                \
        y[i + j + (H)] = a - b;                                          \
      }                                                                  \
  }
SMALL_STAGE(1)
SMALL_STAGE(2)
SMALL_STAGE(4)
SMALL_STAGE(8)

static inline void block(float *restrict y, long n, float s) {
  if (n >= 2) stage1(y, n);
  if (n >= 4) stage2(y, n);
  if (n >= 8) stage4(y, n);
  if (n >= 16) stage8(y, n);
  for (long h = 16; h < n; h <<= 1) stage(y, n, h);
  const uint32_t canon = 0x7fc00000u;
  float nan;
  memcpy(&nan, &canon, 4);
  for (long k = 0; k < n; k++) {
    const float v = y[k] * s;
    y[k] = v != v ? nan : v;
  }
}

/* x: rows of d fp32 values, row r at x + r·x_stride; out: rows·d contiguous (may be x when x_stride = d);
 * sizes, scales: the nb blocks of a row (powers of two summing to d) and their scales. */
void fwht_rows(const float *x, long x_stride, float *out, long rows, long d, const long *sizes,
               const float *scales, int nb) {
  for (long r = 0; r < rows; r++) {
    float *y = out + r * d;
    if (x + r * x_stride != y) memmove(y, x + r * x_stride, (size_t)d * sizeof(float));
    long start = 0;
    for (int b = 0; b < nb; b++) {
      block(y + start, sizes[b], scales[b]);
      start += sizes[b];
    }
  }
}
