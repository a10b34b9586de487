/* Bit packing of uint8 codes into the LSB-first stream of kvqbench.numerics.packing, and back (kvq_pack.h), for
 * kvqbench.numerics.packing.pack_bits / unpack_bits on the CPU: one pass each instead of several torch passes.
 * n: a multiple of 8 codes (whole bytes of the stream at every width). */
#include <stdint.h>

#include "kvq_pack.h"

/* the OR of n codes (a code ≥ 2^bits shows in its bits above bits − 1): the range check, before anything is
 * written */
unsigned kvq_codes_or(const unsigned char *restrict c, long n) {
  unsigned char any = 0;
  for (long k = 0; k < n; k++) any |= c[k];
  return any;
}

void kvq_pack(const unsigned char *restrict c, long n, int bits, unsigned char *restrict out) {
  KVQ_FOR_WIDTH(bits, kvq_pack_row(c, n, B, out); return, return)
}

void kvq_unpack(const unsigned char *restrict p, long n, int bits, unsigned char *restrict c) {
  KVQ_FOR_WIDTH(bits, kvq_unpack_row(p, n, B, c); return, return)
}
