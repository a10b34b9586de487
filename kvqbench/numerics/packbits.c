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
  switch (bits) {  /* a constant width per instance: the loops unroll and vectorize */
    case 1: kvq_pack_row(c, n, 1, out); return;
    case 2: kvq_pack_row(c, n, 2, out); return;
    case 3: kvq_pack_row(c, n, 3, out); return;
    case 4: kvq_pack_row(c, n, 4, out); return;
    case 5: kvq_pack_row(c, n, 5, out); return;
    case 6: kvq_pack_row(c, n, 6, out); return;
    case 7: kvq_pack_row(c, n, 7, out); return;
    default: kvq_pack_row(c, n, 8, out); return;
  }
}

void kvq_unpack(const unsigned char *restrict p, long n, int bits, unsigned char *restrict c) {
  switch (bits) {
    case 1: kvq_unpack_row(p, n, 1, c); return;
    case 2: kvq_unpack_row(p, n, 2, c); return;
    case 3: kvq_unpack_row(p, n, 3, c); return;
    case 4: kvq_unpack_row(p, n, 4, c); return;
    case 5: kvq_unpack_row(p, n, 5, c); return;
    case 6: kvq_unpack_row(p, n, 6, c); return;
    case 7: kvq_unpack_row(p, n, 7, c); return;
    default: kvq_unpack_row(p, n, 8, c); return;
  }
}
