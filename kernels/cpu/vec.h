// Portable 16-lane fp32 vectors (GCC/Clang vector extensions): one AVX-512 register
// where the build machine has it, two AVX2 registers or four NEON ones elsewhere. The
// extension is compiled with -march=native on the machine that runs it
// (kernels/cpu_ops.py), so the same source serves every CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tw {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

constexpr int kLanes = 16;

inline f32x16 splat(float x) { return f32x16{} + x; }

// Loads of 16 consecutive values as fp32 (unaligned).
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;  // bf16 is the top half of fp32
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline f32x16 load16(const int8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
  i8x16 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
#endif
}

// 16 bytes as a vector, and 16 unsigned bytes (codes of quantized weights) as fp32.
typedef uint8_t u8x16 __attribute__((vector_size(16)));

inline u8x16 load_u8x16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x16 u8_to_f32(u8x16 v) {
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, &v, sizeof(b));
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
#else
  return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16);
#endif
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// fp32 -> bf16 with round-to-nearest-even (what torch's .to(bfloat16) does; inputs
// here are finite).
inline void store16(c10::BFloat16* p, f32x16 v) {
#if defined(__AVX512BF16__)
  // the same rounding in one instruction (finite inputs)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
  return;
#endif
  u32x16 w;
  std::memcpy(&w, &v, sizeof(w));
  w = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  u16x16 h = __builtin_convertvector(w, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

#if defined(__AVX512F__)
// r[i] lane j <- r[j] lane i: a 16 x 16 matrix of 32-bit values transposed in registers.
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of 32-bit values
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4 q + j], 128-bit lane l: column 4 l + j of rows 4 q..4 q + 3; two rounds of lane
  // shuffles gather each column's four lanes
  for (int i = 0; i < 4; ++i) {
    for (int h = 0; h < 2; ++h) {
      const int a = i + 8 * h;  // rows i and i + 4 (and i + 8, i + 12)
      t[a] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0x88);
      t[a + 4] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

inline float hsum(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x8 s8 = a + b;
  f32x4 c = __builtin_shufflevector(s8, s8, 0, 1, 2, 3);
  f32x4 d = __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  f32x4 s4 = c + d;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline f32x16 vmax(f32x16 a, f32x16 b) { return a > b ? a : b; }

// 8-lane vectors: what CPUs without AVX-512 hold in one register. Their kernels use these
// (GCC spills 16-lane generic vectors to the stack there once a loop keeps several).
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// (AVX2: written with intrinsics, as GCC builds the generic conversions below from
// scalar moves and inserts there: int8 weights streamed at a sixth of memory speed)
inline f32x8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (f32x8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;  // bf16 is the top half of fp32
  f32x8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline f32x8 load8(const int8_t* p) {
#if defined(__AVX2__)
  return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  i8x8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, i32x8), f32x8);
#endif
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum8(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Lane k of the result = hsum(v[k]), for 16 vectors at once: a butterfly of shuffles and
// adds (~3 operations a vector instead of ~8 for separate horizontal sums). Halving the
// width level by level leaves the sums in bit-reversed lane order, undone at the end.
// V: f32x16 or i32x16.
template <typename V>
inline V hsum16(const V* v) {
  V w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    z[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  const V r = __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26,
                                           12, 28, 14, 30) +
                   __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27,
                                           13, 29, 15, 31);
  return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

inline float hmax(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x8 m8 = a > b ? a : b;
  f32x4 c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  f32x4 d = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  f32x4 m4 = c > d ? c : d;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 as 2^n * p(f): n = round(x log2 e) by one rounding instruction, p a
// polynomial (coefficients c, highest degree first) for 2^f on f in [-0.5, 0.5], and 2^n
// applied by vscalefps: half the instructions of integer exponent arithmetic. Arguments
// at or under -87 give 0 (-inf: f is NaN, masked to 0 with the rest).
template <size_t N>
inline __m512 exp_by_poly(__m512 x, const float (&c)[N]) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  return _mm512_maskz_scalef_ps(live, p, n);
}
#endif

// exp(x) for x <= 0 (softmax arguments), relative error ~2e-7: exp(x) = 2^n * 2^f with
// n = round(x log2 e) and a degree-6 polynomial for 2^f on [-0.5, 0.5]. Arguments under
// -87 flush to 0 (and -inf gives 0).
inline f32x16 vexp(f32x16 x) {
#if defined(__AVX512F__)
  static constexpr float kDegree6[] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                       9.618437357674640e-3f, 5.550332471162809e-2f,
                                       2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
  return (f32x16)exp_by_poly((__m512)x, kDegree6);
#else
  const f32x16 lo = splat(-87.0f);
  x = x < lo ? lo : x;
  f32x16 t = x * 1.44269504088896341f;
  f32x16 n = __builtin_convertvector(__builtin_convertvector(t + (t >= 0 ? 0.5f : -0.5f), i32x16),
                                     f32x16);
  f32x16 f = t - n;  // in [-0.5, 0.5]
  f32x16 p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  f32x16 r = p * scale;
  return x <= lo ? splat(0.0f) : r;
#endif
}

inline float sexp(float x) { return x <= -87.0f ? 0.0f : std::exp(x); }

}  // namespace tw
