// GGUF block-quantized weights used as they are stored in the file (ggml's block
// layouts), for x W^T with a few rows of x and for dequantizing rows into a GEMM's tiles.
//
// Types (values per block, bytes per block):
//   Q8_0 (32, 34):  fp16 d, int8 q[32]                       w = d q
//   Q4_0 (32, 18):  fp16 d, 16 bytes of nibbles              w = d (q - 8); value i in
//                   byte i's low nibble, value 16 + i in its high one
//   Q4_1 (32, 20):  fp16 d, fp16 m, 16 bytes of nibbles      w = d q + m
//   Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes packing 8 six-bit (scale, min) pairs,
//                   128 bytes of nibbles                      w = d sc q - dmin m
//   Q5_K (256, 176): as Q4_K plus 32 bytes holding each value's fifth bit
//   Q6_K (256, 210): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
//                   (one per 16 values), fp16 d               w = d sc (q - 32)
// In the K types each 64 values of a block come from 32 bytes: values [0, 32) from their
// low nibbles and [32, 64) from their high ones (Q6_K: each 128 values from 64 + 32 bytes).
//
// The dot product of a weight row with x never dequantizes w: per group of values that
// share a scale it sums q * x in fp32 and applies the scale once, and a group's offset
// (-dmin m, -8 d, -32 d sc, + m) multiplies the sum of x over the group, computed once per x
// row for all weight rows (XSums).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "amx.h"
#include "linear.h"
#include "vec.h"

namespace tw {

enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's

struct QTypeInfo {
  int64_t block_values, block_bytes;
};

inline QTypeInfo qtype_info(QType t) {
  switch (t) {
    case QType::Q4_0: return {32, 18};
    case QType::Q4_1: return {32, 20};
    case QType::Q8_0: return {32, 34};
    case QType::Q4_K: return {256, 144};
    case QType::Q5_K: return {256, 176};
    case QType::Q6_K: return {256, 210};
  }
  return {0, 0};
}

inline bool qtype_known(int64_t t) {
  return t == 2 || t == 3 || t == 8 || t == 12 || t == 13 || t == 14;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; c10::Half's portable conversion takes a dozen
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block's 12 scale bytes.
inline void k4_scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The 64 codes of chunk c (0-3) of a Q4_K/Q5_K block as four vectors of 16: sub-block
// 2c's values 0-15 and 16-31 (the low nibbles of qs[32c..]), then sub-block 2c + 1's (the
// high nibbles); Q5_K (`five`) adds each value's fifth bit, bit 2c or 2c + 1 of its qh byte
// (h0: qh[0..15], h1: qh[16..31]).
inline void k_chunk_codes(const uint8_t* qs, int c, bool five, u8x16 h0, u8x16 h1,
                          u8x16 out[4]) {
  const u8x16 a = load_u8x16(qs + 32 * c), b = load_u8x16(qs + 32 * c + 16);
  out[0] = a & 0xF;
  out[1] = b & 0xF;
  out[2] = a >> 4;
  out[3] = b >> 4;
  if (five) {
    const uint8_t u1 = uint8_t(1u << (2 * c)), u2 = uint8_t(2u << (2 * c));
    out[0] += (u8x16)((h0 & u1) != 0) & 16;
    out[1] += (u8x16)((h1 & u1) != 0) & 16;
    out[2] += (u8x16)((h0 & u2) != 0) & 16;
    out[3] += (u8x16)((h1 & u2) != 0) & 16;
  }
}

// The 8 six-bit scales and mins of a Q4_K/Q5_K block's 12 scale bytes (k4_scale_min for
// j = 0..7), each set as 8 bytes of a 64-bit word (byte j: sub-block j), computed with
// 32-bit word operations and kept in registers (bytes stored one way and loaded another
// stall the store-to-load forwarding).
inline void k4_scales_all(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4);
  std::memcpy(&w1, s + 4, 4);
  std::memcpy(&w2, s + 8, 4);
  const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
  const uint32_t s03 = w0 & lo6, m03 = w1 & lo6;
  const uint32_t s47 = (w2 & lo4) | (((w0 >> 6) & lo2) << 4);
  const uint32_t m47 = ((w2 >> 4) & lo4) | (((w1 >> 6) & lo2) << 4);
  sc = uint64_t(s03) | (uint64_t(s47) << 32);
  mn = uint64_t(m03) | (uint64_t(m47) << 32);
}

#if defined(__AVX2__)
// f times the 8 bytes of v (k4_scales_all's scales or mins) in fp32: each sub-block's
// d sc, or dmin m.
inline __m256 k4_times(float f, uint64_t v) {
  return _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(v)))));
}
#endif

// Sums of each x row over every 16 values, and over every 32 (the groups' offsets
// multiply them).
struct XSums {
  std::vector<float> s, s32;  // [rows, in / 16], [rows, in / 32]
  int64_t n = 0;
  void fill(const float* xf, int rows, int64_t in) {
    n = in / kLanes;
    s.resize(rows * n);
    s32.resize(rows * (n / 2));
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < n; ++g) s[m * n + g] = hsum(load16(xf + m * in + g * kLanes));
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < n / 2; ++g)
        s32[m * (n / 2) + g] = s[m * n + 2 * g] + s[m * n + 2 * g + 1];
  }
  float at(int m, int64_t g) const { return s[m * n + g]; }
  // the sums over values [32 g, 32 g + 32) of row m, and the ones after it
  const float* at32(int m, int64_t g) const { return s32.data() + m * (n / 2) + g; }
};

// One weight row (`w`, its blocks in order) against M rows of x in fp32 (`xf`, stride
// `in`): sums[m] = w . x_m.
template <int M>
inline void qdot_row(QType t, const uint8_t* w, const float* xf, int64_t in, const XSums& xs,
                     float* sums) {
  f32x16 acc[M] = {};
  float off[M] = {};
  switch (t) {
    case QType::Q8_0: {
      // two sums a row, alternating blocks: one chain of adds would bound the loop by
      // the add's latency rather than by its loads
      f32x16 acc2[M] = {};
      int64_t b = 0;
      const auto block = [&](f32x16* a, int64_t blk, const uint8_t* wb) {
        const float d = half_at(wb);
        const f32x16 v0 = load16(reinterpret_cast<const int8_t*>(wb + 2)),
                     v1 = load16(reinterpret_cast<const int8_t*>(wb + 18));
        for (int m = 0; m < M; ++m) {
          const float* x = xf + m * in + blk * 32;
          a[m] += d * (v0 * load16(x) + v1 * load16(x + 16));
        }
      };
      for (; b + 2 <= in / 32; b += 2, w += 68) {
        block(acc, b, w);
        block(acc2, b + 1, w + 34);
      }
      if (b < in / 32) block(acc, b, w);
      for (int m = 0; m < M; ++m) acc[m] += acc2[m];
      break;
    }
    case QType::Q4_0:
      for (int64_t b = 0; b < in / 32; ++b, w += 18) {
        const float d = half_at(w);
        const u8x16 q = load_u8x16(w + 2);
        const f32x16 lo = u8_to_f32(q & 0xF), hi = u8_to_f32(q >> 4);
        for (int m = 0; m < M; ++m) {
          const float* x = xf + m * in + b * 32;
          acc[m] += d * (lo * load16(x) + hi * load16(x + 16));
          off[m] -= 8.0f * d * (xs.at(m, 2 * b) + xs.at(m, 2 * b + 1));
        }
      }
      break;
    case QType::Q4_1:
      for (int64_t b = 0; b < in / 32; ++b, w += 20) {
        const float d = half_at(w), mn = half_at(w + 2);
        const u8x16 q = load_u8x16(w + 4);
        const f32x16 lo = u8_to_f32(q & 0xF), hi = u8_to_f32(q >> 4);
        for (int m = 0; m < M; ++m) {
          const float* x = xf + m * in + b * 32;
          acc[m] += d * (lo * load16(x) + hi * load16(x + 16));
          off[m] += mn * (xs.at(m, 2 * b) + xs.at(m, 2 * b + 1));
        }
      }
      break;
    case QType::Q4_K:
    case QType::Q5_K: {
      const bool five = t == QType::Q5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t b = 0; b < in / 256; ++b, w += bytes) {
        const float d = half_at(w), dmin = half_at(w + 2);
        const uint8_t* sc = w + 4;
        const uint8_t* qh = w + 16;  // Q5_K's fifth bits
        const uint8_t* qs = w + (five ? 48 : 16);
        const u8x16 h0 = five ? load_u8x16(qh) : u8x16{}, h1 = five ? load_u8x16(qh + 16) : u8x16{};
        for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low nibbles), 2c + 1
          int s1, m1, s2, m2;
          k4_scale_min(2 * c, sc, s1, m1);
          k4_scale_min(2 * c + 1, sc, s2, m2);
          u8x16 k[4];
          k_chunk_codes(qs, c, five, h0, h1, k);
          const f32x16 q0 = u8_to_f32(k[0]), q1 = u8_to_f32(k[1]), q2 = u8_to_f32(k[2]),
                       q3 = u8_to_f32(k[3]);
          const float f1 = d * s1, f2 = d * s2, o1 = dmin * m1, o2 = dmin * m2;
          const int64_t base = b * 256 + c * 64, g = base / kLanes;
          for (int m = 0; m < M; ++m) {
            const float* x = xf + m * in + base;
            acc[m] += f1 * (q0 * load16(x) + q1 * load16(x + 16)) +
                      f2 * (q2 * load16(x + 32) + q3 * load16(x + 48));
            off[m] -= o1 * (xs.at(m, g) + xs.at(m, g + 1)) + o2 * (xs.at(m, g + 2) + xs.at(m, g + 3));
          }
        }
      }
      break;
    }
    case QType::Q6_K:
      for (int64_t b = 0; b < in / 256; ++b, w += 210) {
        const uint8_t* ql = w;
        const uint8_t* qh = w + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        const float d = half_at(w + 208);
        for (int h = 0; h < 2; ++h) {  // 128 values from 64 low-nibble and 32 high-bit bytes
          const uint8_t* l = ql + 64 * h;
          const uint8_t* hh = qh + 32 * h;
          const int8_t* s = sc + 8 * h;
          for (int k = 0; k < 2; ++k) {  // values l = 16k .. 16k + 15 of each quarter
            const u8x16 a = load_u8x16(l + 16 * k), a2 = load_u8x16(l + 32 + 16 * k),
                        hi = load_u8x16(hh + 16 * k);
            const f32x16 q[4] = {u8_to_f32((a & 0xF) | ((hi & 3) << 4)),
                                 u8_to_f32((a2 & 0xF) | (((hi >> 2) & 3) << 4)),
                                 u8_to_f32((a >> 4) | (((hi >> 4) & 3) << 4)),
                                 u8_to_f32((a2 >> 4) | (((hi >> 6) & 3) << 4))};
            for (int j = 0; j < 4; ++j) {  // quarter j: values 32j + 16k .. of the 128
              const float f = d * s[k + 2 * j];
              const int64_t base = b * 256 + h * 128 + 32 * j + 16 * k;
              for (int m = 0; m < M; ++m) {
                acc[m] += f * (q[j] * load16(xf + m * in + base));
                off[m] -= 32.0f * f * xs.at(m, base / kLanes);
              }
            }
          }
        }
      }
      break;
  }
  for (int m = 0; m < M; ++m) sums[m] = hsum(acc[m]) + off[m];
}

#if defined(__AVX512BF16__)
// bf16 activations on a CPU with AVX512-BF16: the quantized values (small integers, exact
// in bf16) are looked up as bf16 from their 4-6 bit codes (vpermw on a table) and multiplied
// with x in pairs by vdpbf16ps: products exact, sums in fp32, as above, in about half the
// instructions of widening each code to fp32.
struct BF16Tables {
  __m512i plain;      // code q -> bf16(q), q < 32
  __m512i minus8;     // q -> bf16(q - 8) (Q4_0)
  __m512i lo32, hi32;  // q -> bf16(q - 32), q < 64 (Q6_K: two halves of the table)
  BF16Tables() {
    uint16_t t[4][32];
    for (int i = 0; i < 32; ++i) {
      t[0][i] = c10::BFloat16(float(i)).x;
      t[1][i] = c10::BFloat16(float(i - 8)).x;
      t[2][i] = c10::BFloat16(float(i - 32)).x;
      t[3][i] = c10::BFloat16(float(i)).x;  // (i + 32 - 32)
    }
    plain = _mm512_loadu_si512(t[0]);
    minus8 = _mm512_loadu_si512(t[1]);
    lo32 = _mm512_loadu_si512(t[2]);
    hi32 = _mm512_loadu_si512(t[3]);
  }
};

inline const BF16Tables& bf16_tables() {
  static const BF16Tables tables;
  return tables;
}

// 32 codes (16-bit lanes) -> 32 bf16 values through a 32-entry table.
inline __m512bh lookup(__m512i codes, __m512i table) {
  return (__m512bh)_mm512_permutexvar_epi16(codes, table);
}

inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// 32 bytes widened to 16-bit lanes.
inline __m512i widen32(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int M>
inline void qdot_row_bf16(QType t, const uint8_t* w, const c10::BFloat16* x, int64_t x_stride,
                          int64_t in, const XSums& xs, float* sums) {
  const BF16Tables& tb = bf16_tables();
  const __m512i nib = _mm512_set1_epi16(0xF);
  // A sums a row of x, taken in turn: one chain of fmadds per row would bound the loop by
  // the fmadd's latency (4 cycles) instead of its throughput; fewer rows need more chains.
  constexpr int A = M == 1 ? 4 : 2;
  __m512 acc[M][A];
  __m256 offv[M];  // K types: the groups' offsets, 8 sub-blocks a lane
  float off[M][2] = {};
  for (int m = 0; m < M; ++m) {
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    offv[m] = _mm256_setzero_ps();
  }
  const __m512 zero = _mm512_setzero_ps();
  switch (t) {
    case QType::Q4_0:
    case QType::Q4_1: {
      const bool one = t == QType::Q4_1;
      const int64_t bytes = one ? 20 : 18;
      for (int64_t b = 0; b < in / 32; ++b, w += bytes) {
        const float d = half_at(w);
        const __m256i q16 =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (one ? 4 : 2))));
        const __m512i codes = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(q16, _mm256_set1_epi16(0xF))),
            _mm256_srli_epi16(q16, 4), 1);
        const __m512bh v = lookup(codes, one ? tb.plain : tb.minus8);
        const __m512 dv = _mm512_set1_ps(d);
        for (int m = 0; m < M; ++m) {
          __m512& a = acc[m][b % A];
          a = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, v, load_bh(x + m * x_stride + b * 32)),
                              dv, a);
          if (one) off[m][b & 1] += half_at(w + 2) * *xs.at32(m, b);
        }
      }
      break;
    }
    case QType::Q4_K:
    case QType::Q5_K: {
      const bool five = t == QType::Q5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t b = 0; b < in / 256; ++b, w += bytes) {
        const float d = half_at(w), dmin = half_at(w + 2);
        const __m512i h = five ? widen32(w + 16) : _mm512_setzero_si512();
        const uint8_t* qs = w + (five ? 48 : 16);
        uint64_t sc8, mn8;
        k4_scales_all(w + 4, sc8, mn8);
        float f[8];  // each sub-block's d sc
        _mm256_storeu_ps(f, k4_times(d, sc8));
        const __m256 mins = k4_times(dmin, mn8);  // each one's dmin m
        for (int m = 0; m < M; ++m)
          offv[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs.at32(m, b * 8)), offv[m]);
        for (int c = 0; c < 4; ++c) {
          const __m512i q = widen32(qs + 32 * c);
          __m512i lo = _mm512_and_si512(q, nib), hi = _mm512_srli_epi16(q, 4);
          if (five) {
            const __m512i one = _mm512_set1_epi16(1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(h, 2 * c), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(h, 2 * c + 1), one), 4));
          }
          const __m512bh v1 = lookup(lo, tb.plain), v2 = lookup(hi, tb.plain);
          const __m512 f1 = _mm512_set1_ps(f[2 * c]), f2 = _mm512_set1_ps(f[2 * c + 1]);
          const int64_t base = b * 256 + c * 64;
          for (int m = 0; m < M; ++m) {
            const c10::BFloat16* xm = x + m * x_stride + base;
            __m512& a1 = acc[m][(2 * c) % A];
            __m512& a2 = acc[m][(2 * c + 1) % A];
            a1 = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, v1, load_bh(xm)), f1, a1);
            a2 = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, v2, load_bh(xm + 32)), f2, a2);
          }
        }
      }
      break;
    }
    case QType::Q6_K:
      for (int64_t b = 0; b < in / 256; ++b, w += 210) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        const float d = half_at(w + 208);
        for (int hf = 0; hf < 2; ++hf) {  // 128 values: quarters of 32
          const uint8_t* ql = w + 64 * hf;
          const __m512i qh = widen32(w + 128 + 32 * hf);
          const int8_t* s = sc + 8 * hf;
          for (int j = 0; j < 4; ++j) {
            const __m512i low = _mm512_and_si512(
                _mm512_srli_epi16(widen32(ql + 32 * (j & 1)), 4 * (j >> 1)), nib);
            const __m512i high = _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(qh, 2 * j), _mm512_set1_epi16(3)), 4);
            const __m512bh v = (__m512bh)_mm512_permutex2var_epi16(
                tb.lo32, _mm512_or_si512(low, high), tb.hi32);
            // values 0-15 of the quarter take scale s[2j], 16-31 s[2j + 1]: lanes 0-7, 8-15
            const __m512 f = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d * s[2 * j]),
                                                  _mm512_set1_ps(d * s[2 * j + 1]));
            const int64_t base = b * 256 + hf * 128 + 32 * j;
            for (int m = 0; m < M; ++m) {
              __m512& a = acc[m][j % A];
              a = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, v, load_bh(x + m * x_stride + base)),
                                  f, a);
            }
          }
        }
      }
      break;
    case QType::Q8_0:
      break;  // (not here: qdot_row)
  }
  for (int m = 0; m < M; ++m) {
    __m512 a = acc[m][0];
    for (int i = 1; i < A; ++i) a = _mm512_add_ps(a, acc[m][i]);
    const __m128 o = _mm_add_ps(_mm256_castps256_ps128(offv[m]), _mm256_extractf128_ps(offv[m], 1));
    sums[m] = _mm512_reduce_add_ps(a) + (off[m][0] + off[m][1]) -
              _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(o, o), o));
  }
}
#endif

#if defined(__AVX2__)
// K types against x quantized to int8 (llama.cpp's approach for its K-quant dot products;
// the code here is ours): each 256 values of an x row take one scale dx = max|x| / 127 and
// x_q = round(x / dx). The 4-6 bit codes then meet x_q as bytes: vpmaddubsw sums code x
// x_q over pairs into 16 bits (at most 63 * 127 * 2, no saturation), vpdpwssd (AVX-512
// VNNI; vpmaddwd and an add on AVX2) multiplies those by the sub-block scales (16 bits)
// and sums into 32-bit lanes, so a sub-block's scale costs nothing per value, and one
// int -> float conversion a 256-value block applies d dx. The offsets (-dmin m, -32 d sc)
// multiply the sums of the quantized x over their groups (dx sum x_q), kept in fp32. About
// a third of the instructions of the bf16 lookup path and a quarter of the fp32 one: the
// decode loop is bound by memory again rather than by the core. x is quantized where the
// caller asks (QPrepared: every bf16 run, and fp32 runs but those asked for by name).
struct XQ {
  std::vector<int8_t> q;     // [rows, in]
  std::vector<float> dx;     // [rows, in / group]
  std::vector<float> sums;   // [rows, in / 16]: dx * (sum of x_q over 16 values)
  std::vector<float> sums32; // [rows, in / 32]
  // [rows, in / 4] where asked (signed_w): -128 times the sum of each 4 x_q, the start of
  // a Q8_0 dot product's vpdpbusd (its codes + 128 meet x_q: this takes the 128 x_q back)
  std::vector<int32_t> neg4;
  int64_t in = 0, group = 256;
  // group: the values that share a scale (256 for the K types, 64 for Q4_0/Q4_1/Q8_0)
  void fill(const float* xf, int rows, int64_t n, int64_t g = 256, bool signed_w = false) {
    in = n;
    group = g;
    const int64_t ng = in / group;
    q.resize(rows * in);
    dx.resize(rows * ng);
    sums.resize(rows * (in / 16));
    sums32.resize(rows * (in / 32));
    neg4.resize(signed_w ? rows * (in / 4) : 0);
    // (16 rows a task: the small kernel's 1-8 rows stay on the calling thread)
    at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < ng; ++b) {
          const float* x = xf + m * in + b * group;
          int8_t* qb = q.data() + m * in + b * group;
          float* sb = sums.data() + m * (in / 16) + b * (group / 16);
          dx[m * ng + b] = quantize_group(x, qb, sb);
          for (int64_t k = 0; k < group / 32; ++k)
            sums32[m * (in / 32) + b * (group / 32) + k] = sb[2 * k] + sb[2 * k + 1];
        }
        if (signed_w)
          for (int64_t i = 0; i < in; i += 4) {
            const int8_t* v = q.data() + m * in + i;
            neg4[m * (in / 4) + i / 4] = -128 * (int32_t(v[0]) + v[1] + v[2] + v[3]);
          }
      }
    });
  }
  const int32_t* neg4_row(int m) const { return neg4.data() + m * (in / 4); }
  const int8_t* row(int m) const { return q.data() + m * in; }

 private:
  // x_q of one group into qb, dx * (sum of x_q) of each 16 values into sb; returns dx
  float quantize_group(const float* x, int8_t* qb, float* sb) const {
#if defined(__AVX512F__)
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float mx = _mm512_reduce_max_ps(amax);
    const float d = mx / 127.0f, inv = mx > 0 ? 127.0f / mx : 0.0f;
    for (int i = 0; i < group; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtsepi32_epi8(v));
      sb[i / 16] = d * float(_mm512_reduce_add_epi32(v));
    }
    return d;
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = mx / 127.0f, inv = mx > 0 ? 127.0f / mx : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    // packs interleave 128-bit lanes: 32-bit groups back into value order
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < group; i += 32) {
      __m256i v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), vinv));
      for (int h = 0; h < 2; ++h) {
        const __m256i s = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        sb[i / 16 + h] = d * float(_mm_cvtsi128_si32(s4));
      }
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), _mm256_permutevar8x32_epi32(b, order));
    }
    return d;
#endif
  }
};
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512i bytes_low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }

// The same 32 bytes in both halves of a vector, the upper half shifted right by `bits`
// (16-bit lanes: the caller masks the bytes).
inline __m512i halves(const uint8_t* p, int bits) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_mask_srli_epi16(v, 0xFFFF0000u, v, bits);
}

// vpshufb controls that spread a block's sub-block scales (words, the same 8 in every
// 128-bit lane) over a 64-value chunk's 16-bit lanes, made once. k4[c]: Q4_K/Q5_K chunk c,
// sub-block 2c's scale in lanes 0-15 and 2c + 1's in lanes 16-31. k6[p]: a Q6_K half's
// quarter pair p, 128-bit lane k taking scale 4 p + k (16 values each).
struct ScalePicks {
  __m512i k4[4], k6[2];
  ScalePicks() {
    alignas(64) int8_t ctl[64];
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 64; ++i) ctl[i] = int8_t(2 * (2 * c + (i >= 32)) + (i & 1));
      k4[c] = _mm512_load_si512(ctl);
    }
    for (int p = 0; p < 2; ++p) {
      for (int i = 0; i < 64; ++i) ctl[i] = int8_t(2 * (4 * p + i / 16) + (i & 1));
      k6[p] = _mm512_load_si512(ctl);
    }
  }
};

inline const ScalePicks& scale_picks() {
  static const ScalePicks picks;
  return picks;
}

// qdot_row_q8 for Q4_0/Q4_1/Q8_0 against x quantized per 64 values: two blocks (64
// values) a step in one vector of 64 codes in value order, `vpdpbusd` with x's bytes to
// 32-bit sums (lanes 0-7 the first block's, 8-15 the second's) scaled by d times dx in fp32.
// Q4_0/Q4_1 spread their nibbles; Q8_0's signed codes become unsigned by flipping the top
// bit (q + 128), and the sums start from -128 times x_q's sums of 4 (XQ::neg4) to take the
// 128 x_q back. The offsets (+m or -8 d) times dx sum(x_q) of both blocks in one 2-lane
// fmadd a row (a scalar chain of adds bounded the loop).
template <int M>
inline void qdot_row_q4(QType t, const uint8_t* w, const XQ& xq, float* sums) {
  const bool one = t == QType::Q4_1, eight = t == QType::Q8_0;
  const int64_t in = xq.in, bs = eight ? 34 : one ? 20 : 18, qo = one ? 4 : 2;
  const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(char(0x80));
  __m512 acc[M];
  __m128 off[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm512_setzero_ps();
    off[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < in / 32; b += 2, w += 2 * bs) {
    __m512i q;
    if (eight) {
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
      const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + bs + 2));
      q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), top);
    } else {
      const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + qo));
      const __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + bs + qo));
      __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(qa), qa, 1);
      v = _mm512_inserti32x4(_mm512_inserti32x4(v, qb, 2), qb, 3);
      // 128-bit lanes 1 and 3 (16-bit lanes 8-15, 24-31): the high nibbles, values 16-31
      q = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4), nib);
    }
    const float da = half_at(w), db = half_at(w + bs);
    const __m512 wd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(da), _mm512_set1_ps(db));
    // the offsets: Q4_1 +m, Q4_0 -8 d (Q8_0's come in with neg4)
    const __m128 o2 = one ? _mm_setr_ps(half_at(w + 2), half_at(w + bs + 2), 0.0f, 0.0f)
                          : _mm_setr_ps(-8.0f * da, -8.0f * db, 0.0f, 0.0f);
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_loadu_si512(xq.row(m) + 32 * b);
      const __m512i start = eight ? _mm512_loadu_si512(xq.neg4_row(m) + 8 * b) : _mm512_setzero_si512();
      const __m512i isum = _mm512_dpbusd_epi32(start, q, xv);
      // x's scale: one for the pair (Q4_0/Q4_1), or one a block (Q8_0, as llama.cpp)
      const __m512 dx = eight ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xq.dx[m * (in / 32) + b]),
                                                     _mm512_set1_ps(xq.dx[m * (in / 32) + b + 1]))
                              : _mm512_set1_ps(xq.dx[m * (in / 64) + b / 2]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, dx), acc[m]);
      if (!eight)
        off[m] = _mm_fmadd_ps(o2, _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                 xq.sums32.data() + m * (in / 32) + b))), off[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 o = _mm_add_ss(off[m], _mm_movehdup_ps(off[m]));
    sums[m] = _mm512_reduce_add_ps(acc[m]) + _mm_cvtss_f32(o);
  }
}

template <int M>
inline void qdot_row_q8(QType t, const uint8_t* w, const XQ& xq, float* sums) {
  if (t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q8_0) return qdot_row_q4<M>(t, w, xq, sums);
  const int64_t in = xq.in, nb = in / 256;
  __m512 acc[M];
  __m512 offv[M];  // the offsets: Q6_K 16 groups a lane set, Q4_K/Q5_K 8 (upper lanes 0)
  for (int m = 0; m < M; ++m) acc[m] = offv[m] = _mm512_setzero_ps();
  if (t == QType::Q4_K || t == QType::Q5_K) {
    const bool five = t == QType::Q5_K;
    // chunk c's scale vector from the 8 scales as words in every 128-bit lane (an in-lane
    // byte shuffle, cheaper than a word permute across lanes): ScalePicks::k4
    const __m512i* pick = scale_picks().k4;
    for (int64_t b = 0; b < nb; ++b, w += five ? 176 : 144) {
      const float d = half_at(w), dmin = half_at(w + 2);
      uint64_t sc8, mn8;
      k4_scales_all(w + 4, sc8, mn8);
      const __m512i s16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8))));
      const __m512 mins = _mm512_zextps256_ps512(k4_times(dmin, mn8));
      const uint8_t* qs = w + (five ? 48 : 16);
      __m512i ia[M][2];
      for (int m = 0; m < M; ++m) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i q = bytes_low(halves(qs + 32 * c, 4));
        if (five) {  // bit 2c (lower half) or 2c + 1 (upper) of each value's qh byte
          const __m512i h = _mm512_srli_epi16(halves(w + 16, 1), 2 * c);
          q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(1)), 4));
        }
        const __m512i sv = _mm512_shuffle_epi8(s16, pick[c]);
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(xq.row(m) + b * 256 + 64 * c);
          ia[m][c & 1] = _mm512_dpwssd_epi32(ia[m][c & 1], _mm512_maddubs_epi16(q, xv), sv);
        }
      }
      for (int m = 0; m < M; ++m) {
        const float dd = d * xq.dx[m * nb + b];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[m][0], ia[m][1])),
                                 _mm512_set1_ps(dd), acc[m]);
        offv[m] = _mm512_fmadd_ps(mins, _mm512_zextps256_ps512(_mm256_loadu_ps(
            xq.sums32.data() + m * (in / 32) + b * 8)), offv[m]);
      }
    }
  } else {  // Q6_K
    // i16 lane i of a 64-value vector: scale 4 p + i / 8 of the half (p: which pair of
    // quarters), picked from the half's 8 scales in every 128-bit lane: ScalePicks::k6
    const __m512i* pick = scale_picks().k6;
    for (int64_t b = 0; b < nb; ++b, w += 210) {
      const float d = half_at(w + 208);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));
      const __m512i s16[2] = {_mm512_broadcast_i32x4(_mm_cvtepi8_epi16(sc)),
                              _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)))};
      const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      __m512i ia[M][2];
      for (int m = 0; m < M; ++m) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // 128 values: 64 bytes of low nibbles, 32 of high pairs
        const __m512i lq = _mm512_loadu_si512(w + 64 * h);
        const __m512i h01 = halves(w + 128 + 32 * h, 2);  // quarters 0 and 1: bits 0-1, 2-3
        const __m512i h23 = _mm512_srli_epi16(h01, 4);     // quarters 2 and 3: bits 4-5, 6-7
        const __m512i top = _mm512_set1_epi8(0x30);
        const __m512i q01 = _mm512_or_si512(bytes_low(lq), _mm512_and_si512(_mm512_slli_epi16(h01, 4), top));
        const __m512i q23 = _mm512_or_si512(bytes_low(_mm512_srli_epi16(lq, 4)),
                                            _mm512_and_si512(_mm512_slli_epi16(h23, 4), top));
        const __m512i s01 = _mm512_shuffle_epi8(s16[h], pick[0]);
        const __m512i s23 = _mm512_shuffle_epi8(s16[h], pick[1]);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xq.row(m) + b * 256 + 128 * h;
          ia[m][0] = _mm512_dpwssd_epi32(ia[m][0], _mm512_maddubs_epi16(q01, _mm512_loadu_si512(x)), s01);
          ia[m][1] = _mm512_dpwssd_epi32(ia[m][1], _mm512_maddubs_epi16(q23, _mm512_loadu_si512(x + 64)), s23);
        }
      }
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[m][0], ia[m][1])),
                                 _mm512_set1_ps(d * xq.dx[m * nb + b]), acc[m]);
        offv[m] = _mm512_fmadd_ps(dsc, _mm512_loadu_ps(xq.sums.data() + m * (in / 16) + b * 16), offv[m]);
      }
    }
    for (int m = 0; m < M; ++m) offv[m] = _mm512_mul_ps(offv[m], _mm512_set1_ps(32.0f));
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[m], offv[m]));
}

// Whether qlinear_small takes type t through qdot_row_q8 for rows of `in` values (Q4_0,
// Q4_1 and Q8_0 take two blocks a step: rows of a multiple of 64).
inline bool qreads_q8(QType t, int64_t in) {
  return t == QType::Q4_K || t == QType::Q5_K || t == QType::Q6_K || in % 64 == 0;
}

// The values x is quantized by for type t (qdot_row_q8): 256 for the K types, 64 for
// Q4_0/Q4_1, 32 for Q8_0 (its 8-bit weights are worth a scale of x a block, as llama.cpp
// gives them: per 64 its mean KL on SmolLM2 was 3.5x the exact sums').
inline int64_t q8_group(QType t) {
  return t == QType::Q8_0 ? 32 : t == QType::Q4_0 || t == QType::Q4_1 ? 64 : 256;
}

// Whether qdot_row_q8 wants XQ::neg4 for type t (Q8_0's signed codes).
inline bool q8_signed(QType t) { return t == QType::Q8_0; }
#elif defined(__AVX2__)
// The int8 dot products on AVX2 (no VNNI): 32 values a vector, vpmaddubsw (code x x_q over
// pairs, 16 bits) then vpmaddwd by the group's scale (or by 1) into 32-bit sums.
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// vpshufb controls that spread 8 scales (words, the same 8 in both 128-bit lanes) over a
// vector's 16-bit lanes, made once: word[k] puts scale k in every lane; pair[j] scale 2j
// in lanes 0-7 and 2j + 1 in lanes 8-15 (a broadcast word each was 3-4 scalar uops).
struct WordPicks {
  __m256i word[8], pair[4];
  WordPicks() {
    alignas(32) int8_t ctl[32];
    for (int k = 0; k < 8; ++k) {
      for (int i = 0; i < 32; ++i) ctl[i] = int8_t(2 * k + (i & 1));
      word[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl));
    }
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 32; ++i) ctl[i] = int8_t(2 * (2 * j + (i >= 16)) + (i & 1));
      pair[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl));
    }
  }
};

inline const WordPicks& word_picks() {
  static const WordPicks picks;
  return picks;
}

// 8 scales as words in both 128-bit lanes (WordPicks' source)
inline __m256i words_both(__m128i w8) { return _mm256_broadcastsi128_si256(w8); }

// Q4_0/Q4_1 (x per 64 values) and Q8_0 (its signed codes: |w| meets x with w's sign), two
// blocks a step (one x scale): the pair's sums in fp32 times d, then one fmadd by dx into
// the row's accumulator, the offsets (+m or -8 d) of both blocks in one fmadd of 2 lanes.
// (One fmadd a block into one accumulator, and a scalar offset chain, bounded the loop.)
template <int M>
inline void qdot_row_q4(QType t, const uint8_t* w, const XQ& xq, float* sums) {
  const bool one = t == QType::Q4_1, eight = t == QType::Q8_0;
  const int64_t in = xq.in, bs = eight ? 34 : one ? 20 : 18, qo = one ? 4 : 2;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  __m128 off[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    off[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < in / 32; b += 2, w += 2 * bs) {
    __m256i uq[2], q[2];
    for (int k = 0; k < 2; ++k) {
      const uint8_t* blk = w + k * bs;
      if (eight) {
        q[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        uq[k] = _mm256_abs_epi8(q[k]);
      } else {  // value i in byte i's low nibble, 16 + i in its high one
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qo));
        uq[k] = q[k] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib);
      }
    }
    const float da = half_at(w), db = half_at(w + bs);
    const __m256 vda = _mm256_set1_ps(da), vdb = _mm256_set1_ps(db);
    const __m128 o2 = eight ? _mm_setzero_ps()
                            : one ? _mm_setr_ps(half_at(w + 2), half_at(w + bs + 2), 0.0f, 0.0f)
                                  : _mm_setr_ps(-8.0f * da, -8.0f * db, 0.0f, 0.0f);
    for (int m = 0; m < M; ++m) {
      const int8_t* x = xq.row(m) + 32 * b;
      __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      if (eight) {
        xa = _mm256_sign_epi8(xa, q[0]);
        xb = _mm256_sign_epi8(xb, q[1]);
      }
      const __m256i ia = _mm256_madd_epi16(_mm256_maddubs_epi16(uq[0], xa), ones);
      const __m256i ib = _mm256_madd_epi16(_mm256_maddubs_epi16(uq[1], xb), ones);
      const __m256 pair = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), vdb,
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(ia), vda));
      acc[m] = _mm256_fmadd_ps(pair, _mm256_set1_ps(xq.dx[m * (in / 64) + b / 2]), acc[m]);
      if (!eight)
        off[m] = _mm_fmadd_ps(o2, _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                 xq.sums32.data() + m * (in / 32) + b))), off[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 o = _mm_add_ss(off[m], _mm_movehdup_ps(off[m]));
    sums[m] = hsum_ps(acc[m]) + _mm_cvtss_f32(o);
  }
}

template <int M>
inline void qdot_row_q8(QType t, const uint8_t* w, const XQ& xq, float* sums) {
  if (t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q8_0)
    return qdot_row_q4<M>(t, w, xq, sums);
  const int64_t in = xq.in, nb = in / 256;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc[M], offv[M];
  for (int m = 0; m < M; ++m) acc[m] = offv[m] = _mm256_setzero_ps();
  const WordPicks& picks = word_picks();
  if (t == QType::Q4_K || t == QType::Q5_K) {
    const bool five = t == QType::Q5_K;
    for (int64_t b = 0; b < nb; ++b, w += five ? 176 : 144) {
      const float d = half_at(w), dmin = half_at(w + 2);
      uint64_t sc8, mn8;
      k4_scales_all(w + 4, sc8, mn8);
      const __m256 mins = k4_times(dmin, mn8);
      const __m256i s16 = words_both(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8))));
      const uint8_t* qs = w + (five ? 48 : 16);
      const __m256i qh = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16))
                              : _mm256_setzero_si256();
      __m256i ia[M];
      for (int m = 0; m < M; ++m) ia[m] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if (five) {  // bit 2c (lo) or 2c + 1 (hi) of each value's qh byte
          const __m256i one = _mm256_set1_epi8(1);
          const __m256i h = _mm256_srli_epi16(qh, 2 * c);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
        }
        const __m256i s_lo = _mm256_shuffle_epi8(s16, picks.word[2 * c]);
        const __m256i s_hi = _mm256_shuffle_epi8(s16, picks.word[2 * c + 1]);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xq.row(m) + b * 256 + 64 * c;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
          ia[m] = _mm256_add_epi32(ia[m], _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s_lo),
              _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s_hi)));
        }
      }
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(d * xq.dx[m * nb + b]),
                                 acc[m]);
        offv[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xq.sums32.data() + m * (in / 32) + b * 8),
                                  offv[m]);
      }
    }
    for (int m = 0; m < M; ++m) sums[m] = hsum_ps(_mm256_sub_ps(acc[m], offv[m]));
    return;
  }
  // Q6_K: each 128 values from 64 bytes of low nibbles and 32 of high pairs; quarter j of
  // them takes scales 2j (its first 16 values) and 2j + 1
  const __m256i top = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const float d = half_at(w + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256 dsc0 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
    const __m256 dsc1 = _mm256_mul_ps(_mm256_set1_ps(d),
                                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))));
    __m256i ia[M];
    for (int m = 0; m < M; ++m) ia[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
      const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(la, nib), _mm256_and_si256(_mm256_slli_epi16(hv, 4), top)),
          _mm256_or_si256(_mm256_and_si256(lb, nib), _mm256_and_si256(_mm256_slli_epi16(hv, 2), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), nib), _mm256_and_si256(hv, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), nib),
                          _mm256_and_si256(_mm256_srli_epi16(hv, 2), top))};
      const __m256i s16 = words_both(_mm_cvtepi8_epi16(h ? _mm_srli_si128(s8, 8) : s8));
      __m256i sv[4];
      for (int j = 0; j < 4; ++j) sv[j] = _mm256_shuffle_epi8(s16, picks.pair[j]);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq.row(m) + b * 256 + 128 * h;
        for (int j = 0; j < 4; ++j)
          ia[m] = _mm256_add_epi32(ia[m], _mm256_madd_epi16(_mm256_maddubs_epi16(
              q[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * j))), sv[j]));
      }
    }
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(d * xq.dx[m * nb + b]),
                               acc[m]);
      const float* s16 = xq.sums.data() + m * (in / 16) + b * 16;
      offv[m] = _mm256_fmadd_ps(dsc0, _mm256_loadu_ps(s16),
                                _mm256_fmadd_ps(dsc1, _mm256_loadu_ps(s16 + 8), offv[m]));
    }
  }
  for (int m = 0; m < M; ++m)
    sums[m] = hsum_ps(_mm256_sub_ps(acc[m], _mm256_mul_ps(offv[m], _mm256_set1_ps(32.0f))));
}

// Whether qlinear_small takes type t through qdot_row_q8 for rows of `in` values (the
// 32-value types take x quantized per 64 values: rows of a multiple of 64).
inline bool qreads_q8(QType t, int64_t in) {
  return t == QType::Q4_K || t == QType::Q5_K || t == QType::Q6_K || in % 64 == 0;
}

inline int64_t q8_group(QType t) {
  return t == QType::Q4_0 || t == QType::Q4_1 || t == QType::Q8_0 ? 64 : 256;
}
#else
inline bool qreads_q8(QType, int64_t) { return false; }
inline int64_t q8_group(QType) { return 256; }
#endif
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
inline bool q8_signed(QType) { return false; }  // (AVX2 meets x with the codes' signs)
#endif

// Whether qlinear_small reads bf16 x as it is (qdot_row_bf16) for type t.
template <typename T>
inline bool qreads_bf16(QType t) {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && t != QType::Q8_0;
#else
  (void)t;
  return false;
#endif
}

#if defined(__AVX512BF16__)
// bf16 values of 32 codes (16-bit lanes, each < 16) of a group whose value for code i is
// f i - o (Q4_1: f i + m, passed as o = -m): a 16-entry table computed in fp32 the way the
// `gguf` package computes each value (the product, then the offset), rounded once, and
// looked up (vpermw) for all 32 codes: one product a table, not one a value. f and o as
// vectors of 16 equal lanes here; table_values takes them as floats.
inline __m512i table_values_v(__m512i codes, __m512 f, __m512 o) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i table = _mm512_castsi256_si512(
      (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(_mm512_mul_ps(f, iota), o)));
  return _mm512_permutexvar_epi16(codes, table);
}

inline __m512i table_values(__m512i codes, float f, float o) {
  return table_values_v(codes, _mm512_set1_ps(f), _mm512_set1_ps(o));
}

// As table_values for codes < 32 (Q5_K): two 16-lane halves of the table.
inline __m512i table_values32(__m512i codes, float f, float o) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 fv = _mm512_set1_ps(f), ov = _mm512_set1_ps(o);
  const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(fv, iota), ov);
  const __m512 hi = _mm512_sub_ps(_mm512_mul_ps(fv, _mm512_add_ps(iota, _mm512_set1_ps(16))), ov);
  return _mm512_permutexvar_epi16(codes, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

inline void store32(c10::BFloat16* p, __m512i v) { _mm512_storeu_si512(p, v); }

// One row of a Q4_0/Q4_1/Q4_K/Q5_K weight dequantized into bf16 through table_values, or
// of a Q6_K weight 32 values a step; false for the types it does not take (Q8_0: the
// general loop).
inline bool dequant_row_tables(QType t, const uint8_t* p, int64_t in, c10::BFloat16* y) {
  const __m512i nib = _mm512_set1_epi16(0xF);
  switch (t) {
    case QType::Q4_0:
    case QType::Q4_1: {
      const bool one = t == QType::Q4_1;
      for (int64_t b = 0; b < in / 32; ++b, p += one ? 20 : 18) {
        const float d = half_at(p);
        const __m256i q16 = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (one ? 4 : 2))));
        const __m512i codes = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(q16, _mm256_set1_epi16(0xF))),
            _mm256_srli_epi16(q16, 4), 1);
        // Q4_1: d q + m; Q4_0: d (q - 8), the product the package computes
        if (one) {
          store32(y + 32 * b, table_values(codes, d, -half_at(p + 2)));
        } else {
          const __m512 iota8 = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
          const __m512i table = _mm512_castsi256_si512(
              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(d), iota8)));
          store32(y + 32 * b, _mm512_permutexvar_epi16(codes, table));
        }
      }
      return true;
    }
    case QType::Q4_K:
    case QType::Q5_K: {
      const bool five = t == QType::Q5_K;
      for (int64_t b = 0; b < in / 256; ++b, p += five ? 176 : 144) {
        const float d = half_at(p), dmin = half_at(p + 2);
        const __m512i h = five ? widen32(p + 16) : _mm512_setzero_si512();
        const uint8_t* qs = p + (five ? 48 : 16);
        uint64_t sc8, mn8;  // the 8 sub-blocks' d sc and dmin m, in vectors (no scalar
        k4_scales_all(p + 4, sc8, mn8);  // work per sub-block: it bounded this loop)
        float f[8], o[8];
        const __m256 fv8 = k4_times(d, sc8), ov8 = k4_times(dmin, mn8);
        _mm256_storeu_ps(f, fv8);
        _mm256_storeu_ps(o, ov8);
        const __m512 fv = _mm512_castps256_ps512(fv8), ov = _mm512_castps256_ps512(ov8);
        for (int c = 0; c < 4; ++c) {
          const float f1 = f[2 * c], o1 = o[2 * c], f2 = f[2 * c + 1], o2 = o[2 * c + 1];
          const __m512i q = widen32(qs + 32 * c);
          __m512i lo = _mm512_and_si512(q, nib), hi = _mm512_srli_epi16(q, 4);
          c10::BFloat16* yc = y + 256 * b + 64 * c;
          if (five) {
            const __m512i one = _mm512_set1_epi16(1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(h, 2 * c), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(h, 2 * c + 1), one), 4));
            store32(yc, table_values32(lo, f1, o1));
            store32(yc + 32, table_values32(hi, f2, o2));
          } else {  // (the factors broadcast from registers, not reloaded from f, o)
            const __m512i i1 = _mm512_set1_epi32(2 * c), i2 = _mm512_set1_epi32(2 * c + 1);
            store32(yc, table_values_v(lo, _mm512_permutexvar_ps(i1, fv),
                                       _mm512_permutexvar_ps(i1, ov)));
            store32(yc + 32, table_values_v(hi, _mm512_permutexvar_ps(i2, fv),
                                            _mm512_permutexvar_ps(i2, ov)));
          }
        }
      }
      return true;
    }
    case QType::Q6_K: {
      // (no table: a scale every 16 values of 64 codes) 32 values a step: their codes
      // assembled as bytes, less 32, widened 16 at a time and multiplied by d sc in fp32,
      // one product each as the package computes it; two rounded to bf16 in one instruction
      const __m256i lo4 = _mm256_set1_epi8(0x0F), lo2 = _mm256_set1_epi8(0x03);
      for (int64_t b = 0; b < in / 256; ++b, p += 210) {
        const float d = half_at(p + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
          for (int j = 0; j < 4; ++j) {  // quarter j: 32 values
            const __m256i ql = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (j & 1)));
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (j >> 1)), lo4);
            const __m256i high = _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), lo2), 4);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
            const __m512 v0 = _mm512_mul_ps(
                _mm512_set1_ps(d * float(sc[8 * h + 2 * j])),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
            const __m512 v1 = _mm512_mul_ps(
                _mm512_set1_ps(d * float(sc[8 * h + 2 * j + 1])),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
            store32(y + 256 * b + 128 * h + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
          }
        }
      }
      return true;
    }
    default:
      return false;
  }
}
#endif

// One weight row's values (its blocks from `p`) into `y` [in] (fp32 or bf16), 16 values at
// a time; each value is d sc q - dmin m (or its type's form) computed as the `gguf` package
// computes it, so the results are the same.
template <typename T>
void dequant_row(QType t, const uint8_t* p, int64_t in, T* y) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (dequant_row_tables(t, p, in, y)) return;
  }
#endif
  const QTypeInfo info = qtype_info(t);
  for (int64_t b = 0; b < in / info.block_values; ++b, p += info.block_bytes) {
    T* yb = y + b * info.block_values;
    switch (t) {
      case QType::Q8_0: {
        const float d = half_at(p);
        store16(yb, d * load16(reinterpret_cast<const int8_t*>(p + 2)));
        store16(yb + 16, d * load16(reinterpret_cast<const int8_t*>(p + 18)));
        break;
      }
      case QType::Q4_0:
      case QType::Q4_1: {
        const bool one = t == QType::Q4_1;
        const float d = half_at(p);
        const u8x16 q = load_u8x16(p + (one ? 4 : 2));
        if (one) {
          const float mn = half_at(p + 2);
          store16(yb, d * u8_to_f32(q & 0xF) + mn);
          store16(yb + 16, d * u8_to_f32(q >> 4) + mn);
        } else {
          store16(yb, d * (u8_to_f32(q & 0xF) - 8.0f));
          store16(yb + 16, d * (u8_to_f32(q >> 4) - 8.0f));
        }
        break;
      }
      case QType::Q4_K:
      case QType::Q5_K: {
        const bool five = t == QType::Q5_K;
        const float d = half_at(p), dmin = half_at(p + 2);
        const u8x16 h0 = five ? load_u8x16(p + 16) : u8x16{},
                    h1 = five ? load_u8x16(p + 32) : u8x16{};
        const uint8_t* qs = p + (five ? 48 : 16);
        for (int c = 0; c < 4; ++c) {
          int s1, m1, s2, m2;
          k4_scale_min(2 * c, p + 4, s1, m1);
          k4_scale_min(2 * c + 1, p + 4, s2, m2);
          u8x16 k[4];
          k_chunk_codes(qs, c, five, h0, h1, k);
          const float f1 = d * float(s1), o1 = dmin * float(m1);
          const float f2 = d * float(s2), o2 = dmin * float(m2);
          T* yc = yb + 64 * c;
          store16(yc, f1 * u8_to_f32(k[0]) - o1);
          store16(yc + 16, f1 * u8_to_f32(k[1]) - o1);
          store16(yc + 32, f2 * u8_to_f32(k[2]) - o2);
          store16(yc + 48, f2 * u8_to_f32(k[3]) - o2);
        }
        break;
      }
      case QType::Q6_K: {
        const float d = half_at(p + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* l = p + 64 * h;
          const uint8_t* hh = p + 128 + 32 * h;
          for (int k = 0; k < 2; ++k) {
            const u8x16 a = load_u8x16(l + 16 * k), a2 = load_u8x16(l + 32 + 16 * k),
                        hi = load_u8x16(hh + 16 * k);
            const u8x16 q[4] = {(a & 0xF) | ((hi & 3) << 4),
                                (a2 & 0xF) | (((hi >> 2) & 3) << 4),
                                (a >> 4) | (((hi >> 4) & 3) << 4),
                                (a2 >> 4) | (((hi >> 6) & 3) << 4)};
            for (int j = 0; j < 4; ++j)
              store16(yb + 128 * h + 32 * j + 16 * k,
                      (d * float(sc[8 * h + k + 2 * j])) * (u8_to_f32(q[j]) - 32.0f));
          }
        }
        break;
      }
    }
  }
}

// Dequantized values of `n` weight rows from `w` (row stride `row_bytes`) into `out`
// [n, in], the rows shared among the threads.
template <typename T>
void dequant_rows(QType t, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t in, T* out) {
  at::parallel_for(0, n, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(t, w + r * row_bytes, in, out + r * in);
  });
}

#if defined(__AVX512BF16__)
// Four sums of 16-lane vectors at once: lane r of the result is the sum of v[r]'s lanes.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(  // each 128-bit lane: a, b, c, d partial sums
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// MB rows of x against 4 consecutive rows of a dequantized tile (bf16, stride `in`):
// s[m][r] = x_m . tile_r, products exact and sums in fp32 (vdpbf16ps), 4 MB independent
// accumulators in registers over the whole row.
template <int MB>
inline void tile_dot(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* tile,
                     int64_t in, float s[][4]) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    __m512bh w[4];
    for (int r = 0; r < 4; ++r) w[r] = load_bh(tile + r * in + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = load_bh(x + m * x_stride + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, w[r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm_storeu_ps(s[m], hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

// y [rows, out] (row stride y_stride) = x W^T (+ bias) for bf16 x with any number of rows
// and a quantized W: the weight rows are taken kPanel at a time (the panels shared among
// the threads), each dequantized once into a small bf16 tile that stays in the core's
// cache while every row of x is multiplied with it. The 4-bit weights are read once a
// call, the tile costs one dequantization per weight for all the rows, and nothing the
// size of the matrix is ever written.
#if defined(TW_AMX)
// Rows [0, rows) of x as AMX B tiles, one 1 KB tile per 16 rows (block b) and 32 values
// (chunk c), at index c * blocks + b (a chunk's blocks side by side): tile row kp holds for each x row m the pair
// x[m][32 c + 2 kp], x[m][32 c + 2 kp + 1] (the matrix unit's pair-interleaved layout: a
// 16 x 16 transpose of 32-bit pairs); rows past `rows` are zeros.
inline void amx_pack_x(const c10::BFloat16* x, int64_t x_stride, int64_t rows, int64_t in,
                       uint32_t* out) {
  const int64_t kc = in / 32, blocks = (rows + 15) / 16;
  at::parallel_for(0, blocks * kc, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i / blocks, b = i % blocks;
      uint32_t* tile = out + i * 256;
      for (int m = 0; m < 16; ++m) {
        uint32_t pairs[16] = {};
        if (b * 16 + m < rows) std::memcpy(pairs, x + (b * 16 + m) * x_stride + 32 * c, 64);
        for (int kp = 0; kp < 16; ++kp) tile[kp * 16 + m] = pairs[kp];
      }
    }
  });
}

// Dequantization of a 32-row weight panel into its bf16 tile (row stride ld), by pieces
// of 256 values (a K block, or 8 blocks of 32) and a few rows at a time, so that it can be
// spread between the matrix unit's products of the piece before.
struct PanelDequant {
  QType t;
  QTypeInfo info;
  const uint8_t* w;  // the panel's first row
  int64_t row_bytes, n, in, ld;  // n: the panel's rows (the rest of the tile stays zero)
  c10::BFloat16* tile;
  static constexpr int64_t kPiece = 256;
  int64_t pieces() const { return (in + kPiece - 1) / kPiece; }
  void rows(int64_t piece, int64_t r0, int64_t r1) const {
    const int64_t v0 = piece * kPiece, len = std::min(kPiece, in - v0);
    for (int64_t r = r0; r < std::min(r1, n); ++r)
      dequant_row(t, w + r * row_bytes + v0 / info.block_values * info.block_bytes, len,
                  tile + r * ld + v0);
  }
};

// A 32-row dequantized weight tile (bf16, row stride `ld`: rows 0-15 the A operand of
// tile 4, rows 16-31 of tile 5) against NB (1 or 2) blocks of 16 x rows (the B operands,
// tiles 6 and 7; xp: the first block's packed tiles, `blocks` tiles a chunk). C tiles 0-3
// hold (weight half h, x block b) at 2 b + h, fp32 [16 weight rows][16 x rows], stored
// into cbuf in that order. Each loaded tile feeds two products and the four accumulators
// are independent: no tile register is loaded again while a product still reads it.
// With `deq`, the tile is dequantized on the way: piece 0 first, then after each 32-value
// chunk's products 4 rows of the next piece, which the core does while the matrix unit
// multiplies (the two overlap instead of taking turns).
template <int NB>
inline void amx_panel(const c10::BFloat16* wt, int64_t in, int64_t ld, const uint32_t* xp,
                      int64_t blocks, float* cbuf, const PanelDequant* deq) {
  const int64_t kc = in / 32;
  constexpr int64_t kPieceChunks = PanelDequant::kPiece / 32;
  const int64_t pieces = deq ? deq->pieces() : 0;
  if (deq) deq->rows(0, 0, 32);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NB > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < kc; ++c) {
    const uint32_t* xc = xp + c * blocks * 256;
    _tile_loadd(4, wt + 32 * c, ld * 2);
    _tile_loadd(6, xc, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, wt + 16 * ld + 32 * c, ld * 2);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, xc + 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t next = c / kPieceChunks + 1, part = c % kPieceChunks;
    if (next < pieces) deq->rows(next, 4 * part, 4 * part + 4);
  }
  _tile_stored(0, cbuf, 64);
  _tile_stored(1, cbuf + 256, 64);
  if constexpr (NB > 1) {
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
  }
}

// qlinear_tiled on the matrix unit: 32 weight rows at a time dequantized into a bf16 tile
// (the A operands, so it needs no transposing) during the first trip of the matrix unit
// through it, against x packed once a pass as B tiles, 32 rows of x per trip.
inline void qlinear_tiled_amx(c10::BFloat16* y, int64_t y_stride, const c10::BFloat16* x,
                              int64_t x_stride, int64_t rows, QType t, const uint8_t* w,
                              int64_t row_bytes, int64_t in, int64_t out,
                              const c10::BFloat16* bias) {
  constexpr int kPanel = 32;
  constexpr int64_t kXBytes = 1 << 20;  // packed x a pass: within L2 beside the tile
  const int64_t kc = in / 32, panels = (out + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(32, kXBytes / (in * 2) / 32 * 32);
  // the tile's rows 64 bytes apart from a multiple of 4 KB: at a stride of 4 KB (in = 2048)
  // the 16 rows of an A load share one L1 set and evict each other
  const int64_t ld = in + 32;
  std::vector<uint32_t> xp(((std::min(rows, chunk) + 15) / 16) * kc * 256);
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {  // each pass dequantizes every panel again
    const int64_t c1 = std::min(rows, c0 + chunk), blocks = (c1 - c0 + 15) / 16;
    amx_pack_x(x + c0 * x_stride, x_stride, c1 - c0, in, xp.data());
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      amx_configure_full();
      std::vector<c10::BFloat16> tile(kPanel * ld);
      alignas(64) float cbuf[4 * 256];
      const __m512i column = _mm512_mullo_epi32(  // offsets of a C tile's column: 16 apart
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(16));
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel, n = std::min<int64_t>(kPanel, out - n0);
        for (int64_t r = n; r < kPanel; ++r)  // the last panel: rows past the matrix are zeros
          std::memset(static_cast<void*>(tile.data() + r * ld), 0, in * 2);
        const PanelDequant deq{t, qtype_info(t), w + n0 * row_bytes, row_bytes, n, in, ld,
                               tile.data()};
        __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
        if (bias) {
          alignas(64) float bv[32] = {};
          for (int64_t j = 0; j < n; ++j) bv[j] = float(bias[n0 + j]);
          bias_lo = _mm512_load_ps(bv);
          bias_hi = _mm512_load_ps(bv + 16);
        }
        for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
          const int nb = int(std::min<int64_t>(2, blocks - b0));
          const uint32_t* xb = xp.data() + b0 * 256;
          const PanelDequant* d = b0 == 0 ? &deq : nullptr;  // the first trip dequantizes
          if (nb == 2)
            amx_panel<2>(tile.data(), in, ld, xb, blocks, cbuf, d);
          else
            amx_panel<1>(tile.data(), in, ld, xb, blocks, cbuf, d);
          // y row r = column m of the block's two C tiles (weight rows 0-15, 16-31)
          const __mmask32 keep = n == 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1);
          for (int b = 0; b < nb; ++b)
            for (int64_t m = 0; m < 16; ++m) {
              const int64_t r = c0 + (b0 + b) * 16 + m;
              if (r >= c1) break;
              const float* col = cbuf + 2 * b * 256 + m;
              __m512 lo = _mm512_i32gather_ps(column, col, 4);
              __m512 hi = _mm512_i32gather_ps(column, col + 256, 4);
              if (bias) {
                lo = _mm512_add_ps(lo, bias_lo);
                hi = _mm512_add_ps(hi, bias_hi);
              }
              _mm512_mask_storeu_epi16(y + r * y_stride + n0, keep,
                                       (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
      }
      _tile_release();
    });
  }
}
#endif

inline void qlinear_tiled(c10::BFloat16* y, int64_t y_stride, const c10::BFloat16* x,
                          int64_t x_stride, int64_t rows, QType t, const uint8_t* w,
                          int64_t row_bytes, int64_t in, int64_t out, const c10::BFloat16* bias) {
#if defined(TW_AMX)
  if (amx_on())
    return qlinear_tiled_amx(y, y_stride, x, x_stride, rows, t, w, row_bytes, in, out, bias);
#endif
  constexpr int kPanel = 16, kMB = 6;
  constexpr int64_t kXBytes = 768 << 10;  // x rows a pass: within a core's L2 beside the tile
  const int64_t panels = (out + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(kMB, kXBytes / (in * 2) / kMB * kMB);
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {  // each pass dequantizes every panel again
  const int64_t c1 = std::min(rows, c0 + chunk);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<c10::BFloat16> tile(kPanel * in);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, n = std::min<int64_t>(kPanel, out - n0);
      for (int64_t r = 0; r < n; ++r) dequant_row(t, w + (n0 + r) * row_bytes, in, tile.data() + r * in);
      if (n < kPanel)  // the last panel: rows past the matrix multiply as zeros
        std::memset(static_cast<void*>(tile.data() + n * in), 0, (kPanel - n) * in * 2);
      for (int64_t j = 0; j < n; j += 4) {
        const c10::BFloat16* tr = tile.data() + j * in;
        for (int64_t m0 = c0; m0 < c1; m0 += kMB) {
          float s[kMB][4];
          const int mb = int(std::min<int64_t>(kMB, c1 - m0));
          const c10::BFloat16* xm = x + m0 * x_stride;
          switch (mb) {
            case 6: tile_dot<6>(xm, x_stride, tr, in, s); break;
            case 5: tile_dot<5>(xm, x_stride, tr, in, s); break;
            case 4: tile_dot<4>(xm, x_stride, tr, in, s); break;
            case 3: tile_dot<3>(xm, x_stride, tr, in, s); break;
            case 2: tile_dot<2>(xm, x_stride, tr, in, s); break;
            default: tile_dot<1>(xm, x_stride, tr, in, s); break;
          }
          const int nr = int(std::min<int64_t>(4, n - j));
          for (int m = 0; m < mb; ++m)
            for (int r = 0; r < nr; ++r) {
              float v = s[m][r];
              if (bias) v += float(bias[n0 + j + r]);
              y[(m0 + m) * y_stride + n0 + j + r] = c10::BFloat16(v);
            }
        }
      }
    }
  });
  }
}
#endif

#if !defined(__AVX2__)
struct XQ {  // (CPUs without AVX2 never quantize x)
  void fill(const float*, int, int64_t, int64_t, bool = false) {}
};
#endif

// What the dot products of one x (1-8 rows) need beside it, made once for every weight
// row: the int8 form of x (where the caller asks for it, int8_x, and the CPU has AVX2:
// qdot_row_q8) or the sums of its fp32 copy over each group (qdot_row, qdot_row_bf16:
// the exact sums of the dequantized weights, up to fp32 rounding).
struct QPrepared {
  XSums xs;
  XQ xq;
  bool q8 = false;
  void fill(QType t, const float* xf, int rows, int64_t in, bool int8_x) {
    q8 = int8_x && qreads_q8(t, in);
    if (q8)
      xq.fill(xf, rows, in, q8_group(t), q8_signed(t));
    else
      xs.fill(xf, rows, in);
  }
};

// Output columns [o0, o1) of y [M, out] (row stride y_stride) = x W^T (+ bias) for a
// quantized W [out rows of row_bytes]; xf: x in fp32, `p` filled from it for type t.
template <int M, typename T>
void qlinear_range(T* y, int64_t y_stride, const T* x, int64_t x_stride, const float* xf,
                   const QPrepared& p, QType t, const uint8_t* w, int64_t row_bytes, int64_t in,
                   const T* bias, int64_t o0, int64_t o1) {
  const bool direct = qreads_bf16<T>(t);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wr = w + o * row_bytes;
    prefetch_w_row(wr, row_bytes);
    float sums[M];
#if defined(__AVX2__)
    if (p.q8) {
      qdot_row_q8<M>(t, wr, p.xq, sums);
      finish_rows(y, y_stride, o, sums, M, nullptr, bias);
      continue;
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (direct) {
        qdot_row_bf16<M>(t, wr, x, x_stride, in, p.xs, sums);
        finish_rows(y, y_stride, o, sums, M, nullptr, bias);
        continue;
      }
    }
#endif
    (void)direct;
    (void)x;
    (void)x_stride;
    qdot_row<M>(t, wr, xf, in, p.xs, sums);
    finish_rows(y, y_stride, o, sums, M, nullptr, bias);
  }
}

// qlinear_range for `rows` (1-8) rows of x.
template <typename T>
void qlinear_range_any(T* y, int64_t y_stride, const T* x, int64_t x_stride, const float* xf,
                       int rows, const QPrepared& p, QType t, const uint8_t* w,
                       int64_t row_bytes, int64_t in, const T* bias, int64_t o0, int64_t o1) {
  switch (rows) {
#define TW_QCASE(M)                                                                        \
  case M:                                                                                  \
    return qlinear_range<M>(y, y_stride, x, x_stride, xf, p, t, w, row_bytes, in, bias, o0, \
                            o1);
    TW_QCASE(1) TW_QCASE(2) TW_QCASE(3) TW_QCASE(4) TW_QCASE(5) TW_QCASE(6) TW_QCASE(7)
    TW_QCASE(8)
#undef TW_QCASE
  }
}

// y [rows, out] (row stride y_stride) = x W^T (+ bias) for 1-8 rows of x and a quantized
// W [out rows of row_bytes], the output rows shared among the threads; xf: x in fp32.
template <typename T>
void qlinear_small_any(T* y, int64_t y_stride, const T* x, int64_t x_stride, const float* xf,
                       int rows, QType t, const uint8_t* w, int64_t row_bytes, int64_t in,
                       int64_t out, const T* bias, bool int8_x) {
  QPrepared p;
  p.fill(t, xf, rows, in, int8_x);
  const int64_t grain = std::max<int64_t>(8, out / (4 * at::get_num_threads()));
  at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) {
    qlinear_range_any(y, y_stride, x, x_stride, xf, rows, p, t, w, row_bytes, in, bias, o0, o1);
  });
}

}  // namespace tw
