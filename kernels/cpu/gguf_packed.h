// Q4_K and Q6_K weights repacked once at load into tiles of 16 rows, for CPUs with
// AVX-512 VNNI.
//
// In a file's own layout each weight row is a run of 256-value blocks, and a dot product
// with x unpacks, per row and block, the sub-block scales and spreads them over the
// vector lanes before the integer products can use them: about 37 vector operations per
// 256 Q4_K weights (qdot_row_q8), which left the small-batch kernel bound by the core's
// two vector ports at ~17 GB/s a core where a bf16 row streams at ~27. Here the 32-bit
// lanes of a vector are 16 weight rows instead: one `vpdpbusd` multiplies 4 consecutive
// codes of each of 16 rows with the same 4 bytes of x (broadcast), so the sum of a
// sub-block for 16 rows lands in one register, and its 16 scales are one byte load and a
// conversion, applied once for 16 rows. About 27 operations per 512 Q4_K weights.
//
// A Q4_K tile: 16 rows r of one 256-value block column, 2,368 bytes (16 blocks are
// 2,304: the six-bit scales are stored as bytes):
//   [0, 32)       d[r], fp16               [32, 64)   dmin[r], fp16
//   [64, 192)     sc[j][r], bytes          [192, 320) m[j][r], bytes   (sub-block j 0-7)
//   [320, 2368)   codes: sub-block j, vector v (0-3), 64 bytes at 320 + 256 j + 64 v; byte
//                 4 r + i holds value 4 v + i of row r's sub-block j in its low nibble and
//                 value 16 + 4 v + i in its high one.
// A Q6_K tile, 3,360 bytes (as its 16 blocks): the 6-bit codes as 4 low bits and 2 high
// ones, 16 int8 scales a row (one a 16 values):
//   [0, 32)       d[r], fp16               [32, 288) sc[k][r], int8    (sub-block k 0-15)
//   [288, 2336)   low bits: values 32 P .. 32 P + 31 (pair P of sub-blocks), vector v, 64
//                 bytes at 288 + 256 P + 64 v: nibbles as Q4_K's codes (low: value
//                 32 P + 4 v + i, high: 32 P + 16 + 4 v + i)
//   [2336, 3360)  high bits: pair P, half h (0-1), 64 bytes at 2336 + 128 P + 64 h; byte
//                 4 r + i holds in bits 2 v, 2 v + 1 those of value 32 P + 16 h + 4 v + i
// A Q8_0 tile, 4,352 bytes (as its 128 blocks): 8 blocks of 32 values a row.
//   [0, 256)      d[k][r], fp16 (block k 0-7)
//   [256, 4352)   codes + 128 (unsigned): block k, vector v (0-7), 64 bytes at 256 +
//                 512 k + 64 v; byte 4 r + i holds value 32 k + 4 v + i of row r
// Tiles in order of row tile, then block column: a matrix is [rows / 16, in / 256, tile
// bytes]. Rows must be a multiple of 16 and in a multiple of 256 (gguf_packs).
#pragma once

#include <ATen/Parallel.h>

#include <cstring>

#include "gguf_gemm.h"
#include "gguf_quant.h"

namespace tw {

constexpr int64_t kPackRows = 16;
constexpr int64_t kPackTileBytes = 2368;   // Q4_K
constexpr int64_t kPackTileBytes6 = 3360;  // Q6_K
constexpr int64_t kPackTileBytes8 = 4352;  // Q8_0
constexpr int64_t kPackedQ4K = 256 + 12;   // the packed forms' type ids (decode_step's qtypes)
constexpr int64_t kPackedQ6K = 256 + 14;
constexpr int64_t kPackedQ8 = 256 + 8;
constexpr int64_t kPackAhead = 4736;  // how far ahead the tiles are asked for
// bf16 batches above this many rows take the integer GEMM (packed_gemm), smaller ones
// packed_range (Q4_K 8192 x 2048 on a Xeon without AMX: 1.15x the GEMM at 16 rows,
// 0.83x at 64)
constexpr int64_t kPackGemmRows = 16;

inline int64_t pack_tile_bytes(QType t) {
  return t == QType::Q6_K ? kPackTileBytes6 : t == QType::Q8_0 ? kPackTileBytes8 : kPackTileBytes;
}

// Whether this build multiplies packed tiles of type t (Q4_K, Q6_K, Q8_0; AVX-512 VNNI).
inline bool packs(QType t) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return t == QType::Q4_K || t == QType::Q6_K || t == QType::Q8_0;
#else
  (void)t;
  return false;
#endif
}

// 16 rows' blocks (row r's at src + r * row_bytes) into one tile at dst.
inline void pack_q4k_tile(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = src + r * row_bytes;
    std::memcpy(dst + 2 * r, blk, 2);
    std::memcpy(dst + 32 + 2 * r, blk + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scale_min(j, blk + 4, sc, m);
      dst[64 + 16 * j + r] = uint8_t(sc);
      dst[192 + 16 * j + r] = uint8_t(m);
    }
    const uint8_t* qs = blk + 16;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* chunk = qs + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 4; ++i) {
          const int lo = (chunk[4 * v + i] >> shift) & 0xF, hi = (chunk[16 + 4 * v + i] >> shift) & 0xF;
          dst[320 + 256 * j + 64 * v + 4 * r + i] = uint8_t(lo | hi << 4);
        }
    }
  }
}

// pack_q4k_tile's inverse: the tile back into 16 rows' blocks.
inline void unpack_q4k_tile(const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  for (int r = 0; r < 16; ++r) {
    uint8_t* blk = dst + r * row_bytes;
    std::memcpy(blk, src + 2 * r, 2);
    std::memcpy(blk + 2, src + 32 + 2 * r, 2);
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = src[64 + 16 * j + r];
      m[j] = src[192 + 16 * j + r];
    }
    uint8_t* s = blk + 4;
    for (int k = 0; k < 4; ++k) {
      s[k] = uint8_t(sc[k] | (sc[k + 4] >> 4) << 6);
      s[k + 4] = uint8_t(m[k] | (m[k + 4] >> 4) << 6);
      s[k + 8] = uint8_t((sc[k + 4] & 0xF) | (m[k + 4] & 0xF) << 4);
    }
    uint8_t* qs = blk + 16;
    std::memset(qs, 0, 128);
    for (int j = 0; j < 8; ++j) {
      uint8_t* chunk = qs + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 4; ++i) {
          const uint8_t b = src[320 + 256 * j + 64 * v + 4 * r + i];
          chunk[4 * v + i] |= uint8_t((b & 0xF) << shift);
          chunk[16 + 4 * v + i] |= uint8_t((b >> 4) << shift);
        }
    }
  }
}

// Value i (0-255) of a Q6_K block as its 6-bit code (0-63): each 128 values from 64 bytes
// of low nibbles (ql) and 32 of high pairs (qh): value 128 n + 32 j + l (j 0-3, l 0-31)
// takes the low (j < 2) or high nibble of ql[64 n + 32 (j % 2) + l] and bits 2 j, 2 j + 1
// of qh[32 n + l].
inline int q6_code(const uint8_t* blk, int i) {
  const int n = i / 128, j = i % 128 / 32, l = i % 32;
  const int lo = (blk[64 * n + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0xF;
  const int hi = (blk[128 + 32 * n + l] >> (2 * j)) & 3;
  return lo | hi << 4;
}

inline void q6_set_code(uint8_t* blk, int i, int code) {  // (blk's codes zeroed first)
  const int n = i / 128, j = i % 128 / 32, l = i % 32;
  blk[64 * n + 32 * (j % 2) + l] |= uint8_t((code & 0xF) << (4 * (j / 2)));
  blk[128 + 32 * n + l] |= uint8_t((code >> 4) << (2 * j));
}

// 16 rows' Q6_K blocks (row r's at src + r * row_bytes) into one tile at dst.
inline void pack_q6k_tile(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  std::memset(dst + 2336, 0, 1024);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = src + r * row_bytes;
    std::memcpy(dst + 2 * r, blk + 208, 2);
    for (int k = 0; k < 16; ++k) dst[32 + 16 * k + r] = blk[192 + k];
    for (int p = 0; p < 8; ++p)
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 4; ++i) {
          const int a = q6_code(blk, 32 * p + 4 * v + i), b = q6_code(blk, 32 * p + 16 + 4 * v + i);
          dst[288 + 256 * p + 64 * v + 4 * r + i] = uint8_t((a & 0xF) | (b & 0xF) << 4);
          dst[2336 + 128 * p + 4 * r + i] |= uint8_t((a >> 4) << (2 * v));
          dst[2336 + 128 * p + 64 + 4 * r + i] |= uint8_t((b >> 4) << (2 * v));
        }
  }
}

// pack_q6k_tile's inverse.
inline void unpack_q6k_tile(const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  for (int r = 0; r < 16; ++r) {
    uint8_t* blk = dst + r * row_bytes;
    std::memset(blk, 0, 192);
    std::memcpy(blk + 208, src + 2 * r, 2);
    for (int k = 0; k < 16; ++k) blk[192 + k] = src[32 + 16 * k + r];
    for (int p = 0; p < 8; ++p)
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 4; ++i) {
          const uint8_t c = src[288 + 256 * p + 64 * v + 4 * r + i];
          const int ha = (src[2336 + 128 * p + 4 * r + i] >> (2 * v)) & 3;
          const int hb = (src[2336 + 128 * p + 64 + 4 * r + i] >> (2 * v)) & 3;
          q6_set_code(blk, 32 * p + 4 * v + i, (c & 0xF) | ha << 4);
          q6_set_code(blk, 32 * p + 16 + 4 * v + i, (c >> 4) | hb << 4);
        }
  }
}

// 16 rows' 8 Q8_0 blocks (256 values; row r's at src + r * row_bytes) into one tile.
inline void pack_q8_tile(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 8; ++k) {
      const uint8_t* blk = src + r * row_bytes + 34 * k;
      std::memcpy(dst + 32 * k + 2 * r, blk, 2);
      for (int v = 0; v < 8; ++v)
        for (int i = 0; i < 4; ++i) dst[256 + 512 * k + 64 * v + 4 * r + i] = blk[2 + 4 * v + i] ^ 0x80;
    }
}

inline void unpack_q8_tile(const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 8; ++k) {
      uint8_t* blk = dst + r * row_bytes + 34 * k;
      std::memcpy(blk, src + 32 * k + 2 * r, 2);
      for (int v = 0; v < 8; ++v)
        for (int i = 0; i < 4; ++i) blk[2 + 4 * v + i] = src[256 + 512 * k + 64 * v + 4 * r + i] ^ 0x80;
    }
}

inline void pack_tile(QType t, const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  if (t == QType::Q8_0) return pack_q8_tile(src, row_bytes, dst);
  if (t == QType::Q6_K)
    pack_q6k_tile(src, row_bytes, dst);
  else
    pack_q4k_tile(src, row_bytes, dst);
}

inline void unpack_tile(QType t, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
  if (t == QType::Q8_0) return unpack_q8_tile(src, dst, row_bytes);
  if (t == QType::Q6_K)
    unpack_q6k_tile(src, dst, row_bytes);
  else
    unpack_q4k_tile(src, dst, row_bytes);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The 6-bit codes of a packed Q6_K tile's pair, vector v: `low4` its values' low bits (a
// nibble a byte), and bits 2 v, 2 v + 1 of the half's high bits moved to bits 4-5 (16-bit
// shifts: what crosses a byte lands outside the mask).
inline __m512i q6_codes(__m512i low4, __m512i high2, int v) {
  __m512i h;
  switch (v) {
    case 0: h = _mm512_slli_epi16(high2, 4); break;
    case 1: h = _mm512_slli_epi16(high2, 2); break;
    case 2: h = high2; break;
    default: h = _mm512_srli_epi16(high2, 2); break;
  }
  return _mm512_ternarylogic_epi32(low4, h, _mm512_set1_epi8(0x30), 0xF8);  // low4 | (h & 0x30)
}

template <typename T>
inline void store16(T* out, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int i = 0; i < 16; ++i) out[i] = T(tmp[i]);
  }
}

// y[m0 + g][16 outputs of a row tile] for G rows of x (quantized per 256 values: XQ with
// group 256) against the tile's block columns from `tiles` on, Q4_K (six = false) or
// Q6_K. Per sub-block pair (32 values: Q4_K one sub-block, Q6_K two), 8 code vectors
// made once for the G rows, each row's 4-byte groups of x broadcast into vpdpbusd.
template <int G, bool six, typename T>
inline void packed_rows(const uint8_t* tiles, int64_t nb, const XQ& xq, int m0, T* y,
                        int64_t y_stride, const T* bias) {
  constexpr int64_t tb = six ? kPackTileBytes6 : kPackTileBytes;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t in = xq.in;
  __m512 tot[G], toff[G];
  for (int g = 0; g < G; ++g) tot[g] = toff[g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * tb;
    if (m0 == 0)  // the stream ahead (as prefetch_w_row: the hardware's alone stalls)
      for (int64_t k = 0; k < tb; k += 64) __builtin_prefetch(t + kPackAhead + k, 0, 1);
    __m512 fs[G], off[G];
    for (int g = 0; g < G; ++g) fs[g] = off[g] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      // the scales (Q4_K: the sub-block's scale and min; Q6_K: its two sub-blocks' scales)
      const auto widen = [&](int at) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + at));
        return _mm512_cvtepi32_ps(six ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
      };
      const __m512 s0 = six ? widen(32 + 32 * j) : widen(64 + 16 * j);
      const __m512 s1 = six ? widen(48 + 32 * j) : widen(192 + 16 * j);
      const uint8_t* q = t + (six ? 288 : 320) + 256 * j;
      __m512i lo[4], hi[4];
      __m512i h0 = _mm512_setzero_si512(), h1 = h0;
      if (six) {
        h0 = _mm512_loadu_si512(t + 2336 + 128 * j);
        h1 = _mm512_loadu_si512(t + 2336 + 128 * j + 64);
      }
      for (int v = 0; v < 4; ++v) {
        const __m512i c = _mm512_loadu_si512(q + 64 * v);
        lo[v] = _mm512_and_si512(c, nib);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
        if (six) {
          lo[v] = q6_codes(lo[v], h0, v);
          hi[v] = q6_codes(hi[v], h1, v);
        }
      }
      for (int g = 0; g < G; ++g) {
        const int8_t* xp = xq.row(m0 + g) + b * 256 + 32 * j;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
          int32_t xl, xh;
          std::memcpy(&xl, xp + 4 * v, 4);
          std::memcpy(&xh, xp + 16 + 4 * v, 4);
          a0 = _mm512_dpbusd_epi32(a0, lo[v], _mm512_set1_epi32(xl));
          a1 = _mm512_dpbusd_epi32(a1, hi[v], _mm512_set1_epi32(xh));
        }
        if (six) {  // w = d sc (q - 32): the offsets are the scales times x's 16-value sums
          const float* s16 = xq.sums.data() + (m0 + g) * (in / 16) + b * 16 + 2 * j;
          fs[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), s0, fs[g]);
          fs[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), s1, fs[g]);
          off[g] = _mm512_fmadd_ps(s0, _mm512_set1_ps(s16[0]), off[g]);
          off[g] = _mm512_fmadd_ps(s1, _mm512_set1_ps(s16[1]), off[g]);
        } else {  // w = d sc q - dmin m
          fs[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), s0, fs[g]);
          off[g] = _mm512_fmadd_ps(s1, _mm512_set1_ps(xq.sums32[(m0 + g) * (in / 32) + b * 8 + j]),
                                   off[g]);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 e = six ? _mm512_mul_ps(d, _mm512_set1_ps(32.0f))
                         : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    for (int g = 0; g < G; ++g) {
      tot[g] = _mm512_fmadd_ps(fs[g], _mm512_mul_ps(d, _mm512_set1_ps(xq.dx[(m0 + g) * nb + b])),
                               tot[g]);
      toff[g] = _mm512_fmadd_ps(off[g], e, toff[g]);
    }
  }
  alignas(64) float bv[16] = {};
  if (bias)
    for (int i = 0; i < 16; ++i) bv[i] = float(bias[i]);
  for (int g = 0; g < G; ++g)
    store16(y + (m0 + g) * y_stride, _mm512_add_ps(_mm512_sub_ps(tot[g], toff[g]), _mm512_load_ps(bv)));
}

// packed_rows for Q8_0 tiles, x quantized per 32 values (XQ group 32, as qdot_row_q4):
// per block of 32 values the 16 rows' sums of (q + 128) x_q, times d dx; the 128 x_q come
// back through x's 32-value sums: y = sum d dx I - 128 sum d (dx sum x_q).
template <int G, typename T>
inline void packed_rows_q8(const uint8_t* tiles, int64_t nb, const XQ& xq, int m0, T* y,
                           int64_t y_stride, const T* bias) {
  const int64_t in = xq.in;
  __m512 tot[G], off[G];
  for (int g = 0; g < G; ++g) tot[g] = off[g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * kPackTileBytes8;
    if (m0 == 0)
      for (int64_t k = 0; k < kPackTileBytes8; k += 64) __builtin_prefetch(t + kPackAhead + k, 0, 1);
    for (int k = 0; k < 8; ++k) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * k)));
      __m512i c[8];
      for (int v = 0; v < 8; ++v) c[v] = _mm512_loadu_si512(t + 256 + 512 * k + 64 * v);
      for (int g = 0; g < G; ++g) {
        const int8_t* xp = xq.row(m0 + g) + b * 256 + 32 * k;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        for (int v = 0; v < 8; v += 2) {
          int32_t x0, x1;
          std::memcpy(&x0, xp + 4 * v, 4);
          std::memcpy(&x1, xp + 4 * v + 4, 4);
          a0 = _mm512_dpbusd_epi32(a0, c[v], _mm512_set1_epi32(x0));
          a1 = _mm512_dpbusd_epi32(a1, c[v + 1], _mm512_set1_epi32(x1));
        }
        const int64_t at = (m0 + g) * (in / 32) + b * 8 + k;
        tot[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)),
                                 _mm512_mul_ps(d, _mm512_set1_ps(xq.dx[at])), tot[g]);
        off[g] = _mm512_fmadd_ps(d, _mm512_set1_ps(xq.sums32[at]), off[g]);
      }
    }
  }
  alignas(64) float bv[16] = {};
  if (bias)
    for (int i = 0; i < 16; ++i) bv[i] = float(bias[i]);
  for (int g = 0; g < G; ++g)
    store16(y + (m0 + g) * y_stride,
            _mm512_add_ps(_mm512_fnmadd_ps(off[g], _mm512_set1_ps(128.0f), tot[g]), _mm512_load_ps(bv)));
}

// G rows of x against a row tile of type t (packed_rows, packed_rows_q8).
template <int G, QType t, typename T>
inline void tile_rows(const uint8_t* tiles, int64_t nb, const XQ& xq, int m0, T* y,
                      int64_t y_stride, const T* bias) {
  if constexpr (t == QType::Q8_0)
    packed_rows_q8<G>(tiles, nb, xq, m0, y, y_stride, bias);
  else
    packed_rows<G, t == QType::Q6_K>(tiles, nb, xq, m0, y, y_stride, bias);
}

template <QType t, typename T>
inline void packed_tiles(T* y, int64_t y_stride, const XQ& xq, int rows, const uint8_t* w,
                         int64_t in, const T* bias, int64_t t0, int64_t t1) {
  const int64_t nb = in / 256;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* tiles = w + tile * nb * pack_tile_bytes(t);
    T* yt = y + tile * kPackRows;
    const T* bt = bias ? bias + tile * kPackRows : nullptr;
    int m0 = 0;
    for (; m0 + 4 <= rows; m0 += 4) tile_rows<4, t>(tiles, nb, xq, m0, yt, y_stride, bt);
    switch (rows - m0) {
      case 3: tile_rows<3, t>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      case 2: tile_rows<2, t>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      case 1: tile_rows<1, t>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      default: break;
    }
  }
}

// Row tiles [t0, t1) of y [rows, out] (row stride y_stride; y points at output 0) for
// every row of the prepared x (XQ with group q8_group(t)), 4 rows of x at a time (a tile's
// bytes stay in L1 between the groups); bias [out] or null.
template <typename T>
inline void packed_range(QType t, T* y, int64_t y_stride, const XQ& xq, int rows, const uint8_t* w,
                         int64_t in, const T* bias, int64_t t0, int64_t t1) {
  if (t == QType::Q8_0)
    packed_tiles<QType::Q8_0>(y, y_stride, xq, rows, w, in, bias, t0, t1);
  else if (t == QType::Q6_K)
    packed_tiles<QType::Q6_K>(y, y_stride, xq, rows, w, in, bias, t0, t1);
  else
    packed_tiles<QType::Q4_K>(y, y_stride, xq, rows, w, in, bias, t0, t1);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// Block b of a packed row tile (t: its bytes; null past the matrix) laid out as the
// integer GEMM's panel half v (gguf_gemm.h PanelBlock): the tile already holds the codes a
// column a lane, four values a lane, so this is splitting nibbles and widening scales.
inline void lay_out_packed(QType qt, const uint8_t* t, PanelBlock& pb, int v) {
  const bool six = qt == QType::Q6_K;
  if (t == nullptr) {
    const __m512i z = _mm512_setzero_si512();
    for (int q = 0; q < 64; ++q) pb.codes[q][v] = z;
    for (int k = 0; k < 16; ++k) pb.scales[k][v] = z;
    for (int k = 0; k < 8; ++k) pb.offs[k][v] = z;
    pb.d[v] = pb.e[v] = _mm512_setzero_ps();
    for (int k = 0; k < 8; ++k) pb.bd[k][v] = pb.bo[k][v] = _mm512_setzero_ps();
    return;
  }
  if (qt == QType::Q8_0) {  // B32: the codes as stored (+ 128), d and o = -128 d a block
    for (int k = 0; k < 8; ++k) {
      pb.bd[k][v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * k)));
      pb.bo[k][v] = _mm512_mul_ps(pb.bd[k][v], _mm512_set1_ps(-128.0f));
      for (int u = 0; u < 8; ++u) pb.codes[8 * k + u][v] = _mm512_loadu_si512(t + 256 + 512 * k + 64 * u);
    }
    return;
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const auto bytes = [&](int at) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + at));
  };
  pb.d[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
  if (six) {  // e = 32 d; offsets: the scales themselves, as word pairs
    pb.e[v] = _mm512_mul_ps(pb.d[v], _mm512_set1_ps(32.0f));
    __m512i sc[16];
    for (int k = 0; k < 16; ++k) pb.scales[k][v] = sc[k] = _mm512_cvtepi8_epi32(bytes(32 + 16 * k));
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    for (int p = 0; p < 8; ++p)
      pb.offs[p][v] = _mm512_or_si512(_mm512_and_si512(sc[2 * p], low16), _mm512_slli_epi32(sc[2 * p + 1], 16));
  } else {
    pb.e[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    __m512i mins[8];
    for (int k = 0; k < 8; ++k) {
      pb.scales[k][v] = _mm512_cvtepu8_epi32(bytes(64 + 16 * k));
      mins[k] = _mm512_cvtepu8_epi32(bytes(192 + 16 * k));
    }
    for (int p = 0; p < 4; ++p)
      pb.offs[p][v] = _mm512_or_si512(mins[2 * p], _mm512_slli_epi32(mins[2 * p + 1], 16));
  }
  for (int j = 0; j < 8; ++j) {  // K quads 8 j + u (low nibbles) and 8 j + 4 + u (high)
    const __m512i h0 = six ? _mm512_loadu_si512(t + 2336 + 128 * j) : nib;
    const __m512i h1 = six ? _mm512_loadu_si512(t + 2336 + 128 * j + 64) : nib;
    for (int u = 0; u < 4; ++u) {
      const __m512i c = _mm512_loadu_si512(t + (six ? 288 : 320) + 256 * j + 64 * u);
      __m512i lo = _mm512_and_si512(c, nib), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
      if (six) {
        lo = q6_codes(lo, h0, u);
        hi = q6_codes(hi, h1, u);
      }
      pb.codes[8 * j + u][v] = lo;
      pb.codes[8 * j + 4 + u][v] = hi;
    }
  }
}

// y [rows, out] (bf16) = x W^T (+ bias) for W packed (out = 16 x its tiles) on the integer
// GEMM (gguf_gemm.h qgemm_panels: 32 weight rows a panel, each x row's four bytes broadcast
// to two vectors of columns): for batches, where it leads packed_range.
inline void packed_gemm(QType t, c10::BFloat16* y, int64_t y_stride, const float* xf, int64_t rows,
                        const uint8_t* w, int64_t in, int64_t out, const c10::BFloat16* bias) {
  const bool six = t == QType::Q6_K, eight = t == QType::Q8_0;
  const int64_t tb = pack_tile_bytes(t);
  XQPairs x;  // (as qlinear_int8: the 32-value types take x per 32)
  x.fill(xf, int(rows), in, six ? 16 : 32, eight ? 32 : 256);
  const int64_t nb = in / 256, tiles = out / kPackRows;
  qgemm_panels(y, y_stride, x, rows, six ? Kind::K6 : eight ? Kind::B32 : Kind::K, w,
               nb * tb / kPackRows, out, bias,
               [&](PanelBlock& pb, int64_t n0, int, int64_t b) {
                 for (int v = 0; v < 2; ++v) {
                   const int64_t tile = n0 / kPackRows + v;
                   lay_out_packed(t, tile < tiles ? w + (tile * nb + b) * tb : nullptr, pb, v);
                 }
               });
}
#endif

}  // namespace tw
