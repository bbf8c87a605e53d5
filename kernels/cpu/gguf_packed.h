// Q4_K weights repacked once at load into tiles of 16 rows, for CPUs with AVX-512 VNNI.
//
// In a file's own layout each weight row is a run of 256-value blocks, and a dot product
// with x unpacks, per row and block, 8 six-bit scales and spreads them over the vector
// lanes before the integer products can use them: about 37 vector operations per 256
// weights (qdot_row_q8), which left the small-batch kernel bound by the core's two vector
// ports at ~17 GB/s a core where a bf16 row streams at ~27. Here the 32-bit lanes of a
// vector are 16 weight rows instead: one `vpdpbusd` multiplies 4 consecutive codes of
// each of 16 rows with the same 4 bytes of x (broadcast), so the sum of a sub-block (32
// values) for 16 rows lands in one register, and its 16 scales are one byte load and a
// conversion, applied once for 16 rows. About 27 operations per 512 weights.
//
// A tile: 16 rows r of one 256-value block column, 2,368 bytes (16 blocks are 2,304: the
// six-bit scales are stored as bytes):
//   [0, 32)       d[r], fp16               [32, 64)   dmin[r], fp16
//   [64, 192)     sc[j][r], bytes          [192, 320) m[j][r], bytes   (sub-block j 0-7)
//   [320, 2368)   codes: sub-block j, vector v (0-3), 64 bytes at 320 + 256 j + 64 v; byte
//                 4 r + i holds value 4 v + i of row r's sub-block j in its low nibble and
//                 value 16 + 4 v + i in its high one.
// Tiles in order of row tile, then block column: a matrix is [rows / 16, in / 256, 2368].
// Rows must be a multiple of 16 and in a multiple of 256 (gguf_packs).
#pragma once

#include <ATen/Parallel.h>

#include <cstring>

#include "gguf_gemm.h"
#include "gguf_quant.h"

namespace tw {

constexpr int64_t kPackRows = 16;
constexpr int64_t kPackTileBytes = 2368;
constexpr int64_t kPackedQ4K = 256 + 12;
constexpr int64_t kPackAhead = 2 * kPackTileBytes;  // how far ahead the tiles are asked for
// bf16 batches above this many rows take the integer GEMM (packed_q4k_gemm), smaller
// ones packed_q4k_range (8192 x 2048 on a Xeon without AMX: even at 16 rows, the GEMM
// 0.83x at 64)
constexpr int64_t kPackGemmRows = 16;  // the packed form's type id (decode_step's qtypes)

// Whether this build multiplies packed Q4_K tiles (AVX-512 VNNI).
inline bool packs_q4k() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// y[m0 + g][16 outputs of row tile `tiles`] for G rows of x (quantized per 256 values:
// XQ with group 256), the tile's block columns from `tiles` on.
template <int G, typename T>
inline void packed_q4k_rows(const uint8_t* tiles, int64_t nb, const XQ& xq, int m0, T* y,
                            int64_t y_stride, const T* bias) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t in = xq.in;
  __m512 tot[G], toff[G];
  for (int g = 0; g < G; ++g) tot[g] = toff[g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * kPackTileBytes;
    if (m0 == 0)  // the stream ahead (as prefetch_w_row: the hardware's alone stalls)
      for (int64_t k = 0; k < kPackTileBytes; k += 64) __builtin_prefetch(t + kPackAhead + k, 0, 1);
    __m512 fs[G], off[G];
    for (int g = 0; g < G; ++g) fs[g] = off[g] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const __m512 scf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 + 16 * j))));
      const __m512 mnf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 192 + 16 * j))));
      const uint8_t* q = t + 320 + 256 * j;
      __m512i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m512i c = _mm512_loadu_si512(q + 64 * v);
        lo[v] = _mm512_and_si512(c, nib);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
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
        fs[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), scf, fs[g]);
        off[g] = _mm512_fmadd_ps(mnf, _mm512_set1_ps(xq.sums32[(m0 + g) * (in / 32) + b * 8 + j]),
                                 off[g]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    for (int g = 0; g < G; ++g) {
      tot[g] = _mm512_fmadd_ps(fs[g], _mm512_mul_ps(d, _mm512_set1_ps(xq.dx[(m0 + g) * nb + b])),
                               tot[g]);
      toff[g] = _mm512_fmadd_ps(off[g], dmin, toff[g]);
    }
  }
  alignas(64) float bv[16] = {};
  if (bias)
    for (int i = 0; i < 16; ++i) bv[i] = float(bias[i]);
  for (int g = 0; g < G; ++g) {
    const __m512 v = _mm512_add_ps(_mm512_sub_ps(tot[g], toff[g]), _mm512_load_ps(bv));
    T* out = y + (m0 + g) * y_stride;
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(out, v);
    } else {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, v);
      for (int i = 0; i < 16; ++i) out[i] = T(tmp[i]);
    }
  }
}

// Row tiles [t0, t1) of y [rows, out] (row stride y_stride; y points at output 0) for
// every row of the prepared x, 4 rows of x at a time (a tile's bytes stay in L1 between
// the groups); bias [out] or null.
template <typename T>
inline void packed_q4k_range(T* y, int64_t y_stride, const XQ& xq, int rows, const uint8_t* w,
                             int64_t in, const T* bias, int64_t t0, int64_t t1) {
  const int64_t nb = in / 256;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* tiles = w + tile * nb * kPackTileBytes;
    T* yt = y + tile * kPackRows;
    const T* bt = bias ? bias + tile * kPackRows : nullptr;
    int m0 = 0;
    for (; m0 + 4 <= rows; m0 += 4) packed_q4k_rows<4>(tiles, nb, xq, m0, yt, y_stride, bt);
    switch (rows - m0) {
      case 3: packed_q4k_rows<3>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      case 2: packed_q4k_rows<2>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      case 1: packed_q4k_rows<1>(tiles, nb, xq, m0, yt, y_stride, bt); break;
      default: break;
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// Block b of packed row tile `tile` laid out as the integer GEMM's panel half v
// (gguf_gemm.h PanelBlock): the tile already holds the codes a column a lane, four
// values a lane, so this is splitting nibbles and widening the bytes of scales and mins.
inline void lay_out_packed(const uint8_t* t, PanelBlock& pb, int v) {
  if (t == nullptr) {  // past the matrix
    const __m512i z = _mm512_setzero_si512();
    for (int q = 0; q < 64; ++q) pb.codes[q][v] = z;
    for (int k = 0; k < 8; ++k) pb.scales[k][v] = z;
    for (int k = 0; k < 4; ++k) pb.offs[k][v] = z;
    pb.d[v] = pb.e[v] = _mm512_setzero_ps();
    return;
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  pb.d[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
  pb.e[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
  __m512i mins[8];
  for (int k = 0; k < 8; ++k) {
    pb.scales[k][v] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 + 16 * k)));
    mins[k] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 192 + 16 * k)));
  }
  for (int p = 0; p < 4; ++p)
    pb.offs[p][v] = _mm512_or_si512(mins[2 * p], _mm512_slli_epi32(mins[2 * p + 1], 16));
  for (int j = 0; j < 8; ++j)
    for (int u = 0; u < 4; ++u) {  // K quads 8 j + u (low nibbles) and 8 j + 4 + u (high)
      const __m512i c = _mm512_loadu_si512(t + 320 + 256 * j + 64 * u);
      pb.codes[8 * j + u][v] = _mm512_and_si512(c, nib);
      pb.codes[8 * j + 4 + u][v] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
    }
}

// y [rows, out] (bf16) = x W^T (+ bias) for W packed (out = 16 x its tiles) on the integer
// GEMM (gguf_gemm.h qgemm_panels: 32 weight rows a panel, each x row's four bytes broadcast
// to two vectors of columns): for batches, where it leads packed_q4k_range.
inline void packed_q4k_gemm(c10::BFloat16* y, int64_t y_stride, const float* xf, int64_t rows,
                            const uint8_t* w, int64_t in, int64_t out, const c10::BFloat16* bias) {
  XQPairs x;
  x.fill(xf, int(rows), in, 32, 256);
  const int64_t nb = in / 256, tiles = out / kPackRows;
  qgemm_panels(y, y_stride, x, rows, Kind::K, w, nb * kPackTileBytes / kPackRows, out, bias,
               [&](PanelBlock& pb, int64_t n0, int, int64_t b) {
                 for (int v = 0; v < 2; ++v) {
                   const int64_t tile = n0 / kPackRows + v;
                   lay_out_packed(tile < tiles ? w + (tile * nb + b) * kPackTileBytes : nullptr, pb, v);
                 }
               });
}
#endif

}  // namespace tw
