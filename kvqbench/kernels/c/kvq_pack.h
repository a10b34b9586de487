/* Bit packing of one code per byte into the LSB-first bit stream of kvqbench.numerics.packing (code i at stream
 * bits [i·b, (i+1)·b), stream bit s = bit s%8 of byte s/8): 8 codes fill b whole bytes (a little-endian word of 8·b
 * bits), and back. Shared by the compiled kernels of kvqbench.numerics (included; kvqbench.numerics.cbuild hashes
 * it with them). */
#ifndef KVQ_PACK_H
#define KVQ_PACK_H

#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvq_pack.h: a little-endian host"
#endif

/* `body` with the constant B equal to bits (1..8), else `otherwise`: one instance per width, so that the loops of
 * each unroll and vectorize for its width. `body` and `otherwise` end the function (return). */
#define KVQ_FOR_WIDTH(bits, body, otherwise) \
  switch (bits) { \
    case 1: { enum { B = 1 }; body; } \
    case 2: { enum { B = 2 }; body; } \
    case 3: { enum { B = 3 }; body; } \
    case 4: { enum { B = 4 }; body; } \
    case 5: { enum { B = 5 }; body; } \
    case 6: { enum { B = 6 }; body; } \
    case 7: { enum { B = 7 }; body; } \
    case 8: { enum { B = 8 }; body; } \
    default: otherwise; \
  }

/* lanes of 2^k bytes each holding its low n bits set (k = 1, 2), or the low n bits of the word (k = 3) */
#define LANES(k, n) ((k) == 1 ? 0x0001000100010001ull * ((1ull << (n)) - 1) \
                   : (k) == 2 ? 0x0000000100000001ull * ((1ull << (n)) - 1) : ((n) >= 64 ? ~0ull : (1ull << (n)) - 1))

/* 8 codes (one per byte of a little-endian word, each < 2^bits) → their 8·bits-bit stream: codes 2j, 2j+1 merged
 * in each 16-bit lane, then the pairs in each 32-bit lane, then the two halves (each odd part shifted down by a
 * multiple of 8 − bits onto the bits just above the even part, both masked) */
static inline __attribute__((always_inline)) uint64_t pack8(uint64_t w, int bits) {
  const int s = 8 - bits;
  w = (w & LANES(1, bits)) | ((w >> s) & (LANES(1, bits) << bits));
  w = (w & LANES(2, 2 * bits)) | ((w >> (2 * s)) & (LANES(2, 2 * bits) << (2 * bits)));
  return (w & LANES(3, 4 * bits)) | ((w >> (4 * s)) & (LANES(3, 4 * bits) << (4 * bits)));
}

/* the inverse of pack8: the 8·bits-bit stream of 8 codes (in the low bits of w) → one code per byte */
static inline __attribute__((always_inline)) uint64_t unpack8(uint64_t w, int bits) {
  const int s = 8 - bits;
  w = (w & LANES(3, 4 * bits)) | ((w << (4 * s)) & (LANES(3, 4 * bits) << 32));
  w = (w & LANES(2, 2 * bits)) | ((w << (2 * s)) & (LANES(2, 2 * bits) << 16));
  return (w & LANES(1, bits)) | ((w << s) & (LANES(1, bits) << 8));
}

/* words that may alias the byte buffers they are read from or written to */
typedef uint16_t __attribute__((may_alias, aligned(1))) kvq_u16;
typedef uint32_t __attribute__((may_alias, aligned(1))) kvq_u32;
typedef uint64_t __attribute__((may_alias, aligned(1))) kvq_u64;

/* n codes (one per byte of c, n a multiple of 8) → their n·bits/8 bytes of stream at out. Widths that divide 8
 * (1, 2, 4): the 8/bits codes of one packed byte, read as one little-endian word (code i in byte i), OR-ed with
 * the word shifted right by multiples of 8 − bits, doubling (code i lands on bits i·bits… of the low byte, the
 * other codes above it), keep the low byte — loops the compiler vectorizes. Other widths: 8 codes at a time
 * (pack8). */
static inline __attribute__((always_inline)) void kvq_pack_row(const unsigned char *restrict c, long n, int bits,
                                                                unsigned char *restrict out) {
  if (bits == 8) {
    memcpy(out, c, (size_t)n);
  } else if (bits == 4) {
    const kvq_u16 *w = (const kvq_u16 *)c;
    for (long k = 0; k < n / 2; k++) {
      const uint16_t v = w[k];
      out[k] = (unsigned char)(v | (v >> 4));
    }
  } else if (bits == 2) {
    const kvq_u32 *w = (const kvq_u32 *)c;
    for (long k = 0; k < n / 4; k++) {
      uint32_t v = w[k];
      v |= v >> 6;
      v |= v >> 12;
      out[k] = (unsigned char)v;
    }
  } else if (bits == 1) {
    const kvq_u64 *w = (const kvq_u64 *)c;
    for (long k = 0; k < n / 8; k++) {
      uint64_t v = w[k];
      v |= v >> 7;
      v |= v >> 14;
      v |= v >> 28;
      out[k] = (unsigned char)v;
    }
  } else {
    for (long k = 0; k < n / 8; k++) {
      uint64_t w;
      memcpy(&w, c + 8 * k, 8);
      w = pack8(w, bits);
      memcpy(out + k * bits, &w, (size_t)bits);  /* little-endian: the low bytes of the word */
    }
  }
}

/* the inverse of kvq_pack_row: the n·bits/8 bytes of stream at p → n codes, one per byte of c (n a multiple of 8).
 * Widths that divide 8: each packed byte OR-ed with itself shifted left by multiples of 8 − bits, doubling (code i
 * lands in byte i of the word), masked to the low bits of every byte */
static inline __attribute__((always_inline)) void kvq_unpack_row(const unsigned char *restrict p, long n, int bits,
                                                                  unsigned char *restrict c) {
  if (bits == 8) {
    memcpy(c, p, (size_t)n);
  } else if (bits == 4) {
    kvq_u16 *w = (kvq_u16 *)c;
    for (long k = 0; k < n / 2; k++) {
      const uint16_t v = p[k];
      w[k] = (uint16_t)((v | (v << 4)) & 0x0F0Fu);
    }
  } else if (bits == 2) {
    kvq_u32 *w = (kvq_u32 *)c;
    for (long k = 0; k < n / 4; k++) {
      uint32_t v = p[k];
      v |= v << 12;
      v |= v << 6;
      w[k] = v & 0x03030303u;
    }
  } else if (bits == 1) {
    kvq_u64 *w = (kvq_u64 *)c;
    for (long k = 0; k < n / 8; k++) {
      uint64_t v = p[k];
      v |= v << 28;
      v |= v << 14;
      v |= v << 7;
      w[k] = v & 0x0101010101010101ull;
    }
  } else {
    for (long k = 0; k < n / 8; k++) {
      uint64_t w = 0;
      memcpy(&w, p + k * bits, (size_t)bits);
      w = unpack8(w, bits);
      memcpy(c + 8 * k, &w, 8);
    }
  }
}

#endif
