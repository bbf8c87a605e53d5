// y = x W^T (* scale) (+ bias) for a few rows of x (decode batches): a matrix-vector
// product that streams W once for all rows at memory speed. W is bf16, fp32 or int8
// (weight-only quantization: one fp32 scale per output channel, applied to the dot
// product). Accumulation is fp32; y rounds to x's dtype.
#pragma once

#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace tw {

constexpr int kMaxLinearRows = 8;
constexpr int64_t kLinearAheadBytes = 4096;  // how far ahead of the row in use W is asked for

// Asks for the W row `kLinearAheadBytes` ahead of row `wr` (of `bytes` bytes): the
// hardware prefetcher alone lets the stream stall whenever the arithmetic falls behind.
inline void prefetch_w_row(const void* wr, int64_t bytes) {
  const char* p = static_cast<const char*>(wr) + ((kLinearAheadBytes + bytes - 1) / bytes) * bytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

template <typename T>
inline void finish_rows(T* y, int64_t out_stride, int64_t o, const float* sums, int M,
                        const float* scale, const T* bias) {
  for (int m = 0; m < M; ++m) {
    float v = sums[m];
    if (scale) v *= scale[o];
    if (bias) v += static_cast<float>(bias[o]);
    y[m * out_stride + o] = static_cast<T>(v);
  }
}

// One output row at a time, four accumulator chains per x row: W is read as one
// sequential stream (interleaving several rows' reads halved the memory speed here).
template <int M, typename TW, typename T>
inline void linear_rows_seq(T* y, int64_t out_stride, const float* xf, const TW* w, int64_t in,
                            int64_t o0, int64_t o1, const float* scale, const T* bias) {
  for (int64_t o = o0; o < o1; ++o) {
    const TW* wr = w + o * in;
    prefetch_w_row(wr, in * int64_t(sizeof(TW)));
    f32x16 a[M][4] = {};
    int64_t i = 0;
    for (; i + 4 * kLanes <= in; i += 4 * kLanes) {
      f32x16 v[4];
      for (int u = 0; u < 4; ++u) v[u] = load16(wr + i + u * kLanes);
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < 4; ++u) a[m][u] += load16(xf + m * in + i + u * kLanes) * v[u];
    }
    for (; i < in; i += kLanes) {
      const f32x16 v = load16(wr + i);
      for (int m = 0; m < M; ++m) a[m][0] += load16(xf + m * in + i) * v;
    }
    float sums[M];
    for (int m = 0; m < M; ++m) sums[m] = hsum((a[m][0] + a[m][1]) + (a[m][2] + a[m][3]));
    finish_rows(y, out_stride, o, sums, M, scale, bias);
  }
}

#if defined(__AVX512BF16__)
// bf16 weights and activations: pairs of products summed in fp32 by vdpbf16ps, no
// conversion of W at all; one row at a time, four chains, as above.
template <int M>
void linear_rows_bf16dp(c10::BFloat16* y, int64_t out_stride, const c10::BFloat16* x,
                        int64_t x_stride, const c10::BFloat16* w, int64_t in, int64_t o0,
                        int64_t o1, const c10::BFloat16* bias) {
  constexpr int kStep = 32;  // bf16 per vector
  for (int64_t o = o0; o < o1; ++o) {
    const c10::BFloat16* wr = w + o * in;
    prefetch_w_row(wr, in * 2);
    __m512 a[M][4];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < 4; ++u) a[m][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 * kStep <= in; i += 4 * kStep) {
      __m512bh v[4];
      for (int u = 0; u < 4; ++u) v[u] = (__m512bh)_mm512_loadu_si512(wr + i + u * kStep);
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < 4; ++u)
          a[m][u] = _mm512_dpbf16_ps(
              a[m][u], (__m512bh)_mm512_loadu_si512(x + m * x_stride + i + u * kStep), v[u]);
    }
    for (; i < in; i += kStep) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(wr + i);
      for (int m = 0; m < M; ++m)
        a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)_mm512_loadu_si512(x + m * x_stride + i), v);
    }
    float sums[M];
    for (int m = 0; m < M; ++m)
      sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]),
                                                   _mm512_add_ps(a[m][2], a[m][3])));
    finish_rows(y, out_stride, o, sums, M, nullptr, bias);
  }
}
#endif

inline constexpr bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

template <typename T>
inline void to_fp32(float* xf, const T* x, int64_t x_stride, int rows, int64_t in) {
  for (int m = 0; m < rows; ++m)
    for (int64_t i = 0; i < in; i += kLanes) store16(xf + m * in + i, load16(x + m * x_stride + i));
}

// Whether x W^T reads x as it is (bf16 pairs) rather than its fp32 copy.
template <typename TW, typename T>
inline bool reads_x_directly(int64_t in, const float* scale) {
  return has_bf16_dot() && std::is_same_v<TW, c10::BFloat16> && std::is_same_v<T, c10::BFloat16> &&
         in % 32 == 0 && scale == nullptr;
}

#if !defined(__AVX512F__)
// Without AVX-512 (16 vector registers of 8 floats) GCC does not keep the 16-lane
// generic vectors above in registers once there are several rows: their accumulators
// went through the stack, and a matmul of 5 rows ran at a fifth of the arithmetic the
// CPU has (measured on an AVX2 EPYC: 14 GFLOP/s on two cores, whatever the rows). This
// path uses 8-lane vectors (vec.h), two accumulator chains per row: 2M + 2 registers.
template <int M, typename TW, typename T>
inline void linear_rows_avx2(T* y, int64_t out_stride, const float* xf, const TW* w, int64_t in,
                             int64_t o0, int64_t o1, const float* scale, const T* bias) {
  for (int64_t o = o0; o < o1; ++o) {
    const TW* wr = w + o * in;
    prefetch_w_row(wr, in * int64_t(sizeof(TW)));
    f32x8 a[M][2] = {};
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const f32x8 v0 = load8(wr + i), v1 = load8(wr + i + 8);
      for (int m = 0; m < M; ++m) {
        a[m][0] += load8(xf + m * in + i) * v0;
        a[m][1] += load8(xf + m * in + i + 8) * v1;
      }
    }
    for (; i < in; i += 8) {
      const f32x8 v = load8(wr + i);
      for (int m = 0; m < M; ++m) a[m][0] += load8(xf + m * in + i) * v;
    }
    float sums[M];
    for (int m = 0; m < M; ++m) sums[m] = hsum8(a[m][0] + a[m][1]);
    finish_rows(y, out_stride, o, sums, M, scale, bias);
  }
}
#endif

template <int M, typename TW, typename T>
void linear_range_m(T* y, const T* x, int64_t x_stride, const float* xf, const TW* w, int64_t in,
                    int64_t out, const float* scale, const T* bias, int64_t o0, int64_t o1) {
#if !defined(__AVX512F__)
  return linear_rows_avx2<M>(y, out, xf, w, in, o0, o1, scale, bias);
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TW, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>) {
    if (reads_x_directly<TW, T>(in, scale))
      return linear_rows_bf16dp<M>(y, out, x, x_stride, w, in, o0, o1, bias);
  }
#endif
  linear_rows_seq<M>(y, out, xf, w, in, o0, o1, scale, bias);
}

// Output columns [o0, o1) of y [rows, out] = x W^T; `xf` holds x in fp32 (to_fp32) unless
// reads_x_directly.
template <typename TW, typename T>
void linear_range(T* y, const T* x, int64_t x_stride, const float* xf, const TW* w, int64_t in,
                  int64_t out, int rows, const float* scale, const T* bias, int64_t o0,
                  int64_t o1) {
  switch (rows) {
#define TW_CASE(M) \
  case M: return linear_range_m<M>(y, x, x_stride, xf, w, in, out, scale, bias, o0, o1);
    TW_CASE(1) TW_CASE(2) TW_CASE(3) TW_CASE(4) TW_CASE(5) TW_CASE(6) TW_CASE(7) TW_CASE(8)
#undef TW_CASE
  }
}

template <int M, typename TW, typename T>
void linear_small_impl(T* y, const T* x, int64_t x_stride, const TW* w, int64_t in, int64_t out,
                       const float* scale, const T* bias) {
  const int64_t grain = std::max<int64_t>(16, out / (4 * at::get_num_threads()));
  std::vector<float> xf;
  if (!reads_x_directly<TW, T>(in, scale)) {
    xf.resize(M * in);
    to_fp32(xf.data(), x, x_stride, M, in);
  }
  at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) {
    linear_range_m<M>(y, x, x_stride, xf.data(), w, in, out, scale, bias, o0, o1);
  });
}

template <typename TW, typename T>
void linear_small_any(T* y, const T* x, int64_t x_stride, const TW* w, int64_t in, int64_t out,
                      int64_t rows, const float* scale, const T* bias) {
  switch (rows) {
    case 1: return linear_small_impl<1>(y, x, x_stride, w, in, out, scale, bias);
    case 2: return linear_small_impl<2>(y, x, x_stride, w, in, out, scale, bias);
    case 3: return linear_small_impl<3>(y, x, x_stride, w, in, out, scale, bias);
    case 4: return linear_small_impl<4>(y, x, x_stride, w, in, out, scale, bias);
    case 5: return linear_small_impl<5>(y, x, x_stride, w, in, out, scale, bias);
    case 6: return linear_small_impl<6>(y, x, x_stride, w, in, out, scale, bias);
    case 7: return linear_small_impl<7>(y, x, x_stride, w, in, out, scale, bias);
    case 8: return linear_small_impl<8>(y, x, x_stride, w, in, out, scale, bias);
  }
}

}  // namespace tw
