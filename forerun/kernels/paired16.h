// The AVX2 inner step that the packed GGUF tiles (gguf_packed_rows.cpp: Q4_K) and forerun's int4
// (int4_rows.cpp) share: one token's 16 inputs against two 64-byte weight vectors of a 16-row
// tile, both 8-row halves per broadcast. Both layouts hold, in vector v, byte 4*l + j, the low
// nibble of input 8v + j of row l and the high nibble of input 8v + 4 + j; bytes 0-31 are rows
// 0-7, bytes 32-63 rows 8-15. The caller unpacks the nibbles once and keeps them in registers
// while every token's step runs:
//   l00 / h00  vector v,     rows 0-7   (low / high nibbles: inputs 8v..8v+3 / 8v+4..8v+7)
//   l01 / h01  vector v + 1, rows 0-7
//   l10 / h10, l11 / h11      the same for rows 8-15
// and the step adds, per row, s * (sum of the 16 products) into the int32 lanes of i0 (rows 0-7)
// and i1 (rows 8-15): the four maddubs results summed in int16 (each |result| <= 2 x 15 x 127, so
// at most 15240, no overflow), then one madd by s0 / s1 (a row's 16-bit factor in both halves of
// its lane: a Q4_K sub-block's scale, or ones). Exact integer sums, so the same int32 as any
// other order of the same products.
//
// Inline assembly because GCC, short of AVX2's 16 ymm registers, unpacked the weights again
// inside the token loop and stored each sum twice. The 16 inputs are broadcast 4 bytes at a
// time from memory (a load, no shuffle).
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

// A token's 16 inputs at %[a], broadcast 4 bytes at a time into ymm12-15 (the Q6_K tile's own
// assembly in gguf_packed_rows.cpp starts with them too).
#define BROADCAST_16_INPUTS                  \
  "vpbroadcastd (%[a]), %%ymm12\n\t"        \
  "vpbroadcastd 4(%[a]), %%ymm13\n\t"       \
  "vpbroadcastd 8(%[a]), %%ymm14\n\t"       \
  "vpbroadcastd 12(%[a]), %%ymm15\n\t"

// Those 16 bytes as the asm's memory operand (it addresses them through a register): so the
// compiler knows the asm reads them and keeps their stores before it.
inline const int8_t (&inputs16(const int8_t* a))[16] { return *reinterpret_cast<const int8_t(*)[16]>(a); }

__attribute__((always_inline)) inline void paired16_step(const int8_t* a, __m256i l00, __m256i h00, __m256i l01,
                                                         __m256i h01, __m256i l10, __m256i h10, __m256i l11,
                                                         __m256i h11, const __m256i& s0, const __m256i& s1,
                                                         __m256i& i0, __m256i& i1) {
  asm volatile(
      BROADCAST_16_INPUTS
      "vpmaddubsw %%ymm12, %[l00], %%ymm8\n\t"
      "vpmaddubsw %%ymm13, %[h00], %%ymm9\n\t"
      "vpmaddubsw %%ymm12, %[l10], %%ymm10\n\t"
      "vpmaddubsw %%ymm13, %[h10], %%ymm11\n\t"
      "vpaddw %%ymm9, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm11, %%ymm10, %%ymm10\n\t"
      "vpmaddubsw %%ymm14, %[l01], %%ymm9\n\t"
      "vpmaddubsw %%ymm15, %[h01], %%ymm12\n\t"
      "vpmaddubsw %%ymm14, %[l11], %%ymm11\n\t"
      "vpmaddubsw %%ymm15, %[h11], %%ymm13\n\t"
      "vpaddw %%ymm12, %%ymm9, %%ymm9\n\t"
      "vpaddw %%ymm13, %%ymm11, %%ymm11\n\t"
      "vpaddw %%ymm9, %%ymm8, %%ymm8\n\t"
      "vpaddw %%ymm11, %%ymm10, %%ymm10\n\t"
      "vpmaddwd %[s0], %%ymm8, %%ymm8\n\t"
      "vpmaddwd %[s1], %%ymm10, %%ymm10\n\t"
      "vpaddd %[i0], %%ymm8, %%ymm8\n\t"
      "vpaddd %[i1], %%ymm10, %%ymm10\n\t"
      "vmovdqa %%ymm8, %[i0]\n\t"
      "vmovdqa %%ymm10, %[i1]\n\t"
      : [i0] "+m"(i0), [i1] "+m"(i1)
      : [a] "r"(a), [in] "m"(inputs16(a)), [l00] "x"(l00), [h00] "x"(h00), [l01] "x"(l01), [h01] "x"(h01),
        [l10] "x"(l10), [h10] "x"(h10), [l11] "x"(l11), [h11] "x"(h11), [s0] "m"(s0), [s1] "m"(s1)
      : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#endif
