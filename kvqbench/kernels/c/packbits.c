/* Bit packing of uint8 codes into the LSB-first stream of kvqbench.numerics.packing, and back (kvq_pack.h): the fast
 * versions of the steps packing.pack and packing.unpack (kvqbench.kernels.packing), one pass each.
 * n: a multiple of 8 codes (whole bytes of the stream at every width). */
#include <stdint.h>

#include "kvq_pack.h"

void kvq_pack(const unsigned char *restrict c, long n, int bits, unsigned char *restrict out) {
  KVQ_FOR_WIDTH(bits, kvq_pack_row(c, n, B, out); return, return)
}

void kvq_unpack(const unsigned char *restrict p, long n, int bits, unsigned char *restrict c) {
  KVQ_FOR_WIDTH(bits, kvq_unpack_row(p, n, B, c); return, return)
}
