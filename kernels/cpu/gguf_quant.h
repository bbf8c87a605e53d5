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
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

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
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

inline u8x16 load_u8x16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x16 u8_to_f32(u8x16 v) {
  return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16);
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

// Sums of each x row over every 16 values (the groups' offsets multiply them).
struct XSums {
  std::vector<float> s;  // [rows, in / 16]
  int64_t n = 0;
  void fill(const float* xf, int rows, int64_t in) {
    n = in / kLanes;
    s.resize(rows * n);
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < n; ++g) s[m * n + g] = hsum(load16(xf + m * in + g * kLanes));
  }
  float at(int m, int64_t g) const { return s[m * n + g]; }
};

// One weight row (`w`, its blocks in order) against M rows of x in fp32 (`xf`, stride
// `in`): sums[m] = w . x_m.
template <int M>
inline void qdot_row(QType t, const uint8_t* w, const float* xf, int64_t in, const XSums& xs,
                     float* sums) {
  f32x16 acc[M] = {};
  float off[M] = {};
  switch (t) {
    case QType::Q8_0:
      for (int64_t b = 0; b < in / 32; ++b, w += 34) {
        const float d = half_at(w);
        i8x16 q0, q1;
        std::memcpy(&q0, w + 2, 16);
        std::memcpy(&q1, w + 18, 16);
        const f32x16 v0 = __builtin_convertvector(__builtin_convertvector(q0, i32x16), f32x16);
        const f32x16 v1 = __builtin_convertvector(__builtin_convertvector(q1, i32x16), f32x16);
        for (int m = 0; m < M; ++m) {
          const float* x = xf + m * in + b * 32;
          acc[m] += d * (v0 * load16(x) + v1 * load16(x + 16));
        }
      }
      break;
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
          const u8x16 a = load_u8x16(qs + 32 * c), bb = load_u8x16(qs + 32 * c + 16);
          u8x16 la = a & 0xF, lb = bb & 0xF, ha = a >> 4, hb = bb >> 4;
          if (five) {
            const uint8_t u1 = uint8_t(1u << (2 * c)), u2 = uint8_t(2u << (2 * c));
            la += (u8x16)((h0 & u1) != 0) & 16;
            lb += (u8x16)((h1 & u1) != 0) & 16;
            ha += (u8x16)((h0 & u2) != 0) & 16;
            hb += (u8x16)((h1 & u2) != 0) & 16;
          }
          const f32x16 q0 = u8_to_f32(la), q1 = u8_to_f32(lb), q2 = u8_to_f32(ha),
                       q3 = u8_to_f32(hb);
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

// Dequantized values of `n` weight rows from `w` (row stride `row_bytes`) into `out`
// [n, in] (fp32 or bf16).
template <typename T>
void dequant_rows(QType t, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t in, T* out) {
  at::parallel_for(0, n, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> one(256);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* p = w + r * row_bytes;
      T* y = out + r * in;
      const QTypeInfo info = qtype_info(t);
      for (int64_t b = 0; b < in / info.block_values; ++b, p += info.block_bytes) {
        float* v = one.data();
        switch (t) {
          case QType::Q8_0: {
            const float d = half_at(p);
            for (int i = 0; i < 32; ++i) v[i] = d * float(int8_t(p[2 + i]));
            break;
          }
          case QType::Q4_0: {
            const float d = half_at(p);
            for (int i = 0; i < 16; ++i) {
              v[i] = d * float(int(p[2 + i] & 0xF) - 8);
              v[i + 16] = d * float(int(p[2 + i] >> 4) - 8);
            }
            break;
          }
          case QType::Q4_1: {
            const float d = half_at(p), mn = half_at(p + 2);
            for (int i = 0; i < 16; ++i) {
              v[i] = d * float(p[4 + i] & 0xF) + mn;
              v[i + 16] = d * float(p[4 + i] >> 4) + mn;
            }
            break;
          }
          case QType::Q4_K:
          case QType::Q5_K: {
            const bool five = t == QType::Q5_K;
            const float d = half_at(p), dmin = half_at(p + 2);
            const uint8_t* qh = p + 16;
            const uint8_t* qs = p + (five ? 48 : 16);
            for (int c = 0; c < 4; ++c) {
              int s1, m1, s2, m2;
              k4_scale_min(2 * c, p + 4, s1, m1);
              k4_scale_min(2 * c + 1, p + 4, s2, m2);
              for (int l = 0; l < 32; ++l) {
                int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
                if (five) {
                  lo += (qh[l] >> (2 * c)) & 1 ? 16 : 0;
                  hi += (qh[l] >> (2 * c + 1)) & 1 ? 16 : 0;
                }
                v[64 * c + l] = d * s1 * lo - dmin * m1;
                v[64 * c + 32 + l] = d * s2 * hi - dmin * m2;
              }
            }
            break;
          }
          case QType::Q6_K: {
            const float d = half_at(p + 208);
            const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
            for (int h = 0; h < 2; ++h) {
              const uint8_t* ql = p + 64 * h;
              const uint8_t* qh = p + 128 + 32 * h;
              const int8_t* s = sc + 8 * h;
              for (int l = 0; l < 32; ++l) {
                const int k = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                v[128 * h + l] = d * s[k] * q1;
                v[128 * h + l + 32] = d * s[k + 2] * q2;
                v[128 * h + l + 64] = d * s[k + 4] * q3;
                v[128 * h + l + 96] = d * s[k + 6] * q4;
              }
            }
            break;
          }
        }
        for (int64_t i = 0; i < info.block_values; ++i)
          y[b * info.block_values + i] = static_cast<T>(v[i]);
      }
    }
  });
}

// y [M, out] (row stride y_stride) = x W^T (+ bias) for a quantized W [out rows of
// row_bytes]; xf: x in fp32.
template <int M, typename T>
void qlinear_small_impl(T* y, int64_t y_stride, const float* xf, QType t, const uint8_t* w,
                        int64_t row_bytes, int64_t in, int64_t out, const T* bias) {
  XSums xs;
  xs.fill(xf, M, in);
  const int64_t grain = std::max<int64_t>(8, out / (4 * at::get_num_threads()));
  at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      const uint8_t* wr = w + o * row_bytes;
      prefetch_w_row(wr, row_bytes);
      float sums[M];
      qdot_row<M>(t, wr, xf, in, xs, sums);
      finish_rows(y, y_stride, o, sums, M, nullptr, bias);
    }
  });
}

template <typename T>
void qlinear_small_any(T* y, int64_t y_stride, const float* xf, int rows, QType t,
                       const uint8_t* w, int64_t row_bytes, int64_t in, int64_t out,
                       const T* bias) {
  switch (rows) {
#define TW_QCASE(M) \
  case M: return qlinear_small_impl<M>(y, y_stride, xf, t, w, row_bytes, in, out, bias);
    TW_QCASE(1) TW_QCASE(2) TW_QCASE(3) TW_QCASE(4) TW_QCASE(5) TW_QCASE(6) TW_QCASE(7)
    TW_QCASE(8)
#undef TW_QCASE
  }
}

}  // namespace tw
