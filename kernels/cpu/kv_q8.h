// The int8 KV cache ("q8"): half the bytes of a bf16 cache, so decode attention, which
// is bound by how fast the cache streams from memory, reads half as much.
//
// Layout of one layer's K (and V) cache, uint8 [kv_heads, num_blocks, block_bytes] with
// block_bytes = block_size * (head_dim + 4): each (KV head, block) holds block_size rows
// of head_dim one-byte codes, then the rows' block_size fp32 scales. A row x of the
// model's K or V is stored as scale = max|x| / 127 and codes c = round(x / scale) in
// [-127, 127] (round half to even; all zeros when x is), so x ~ c * scale. K codes are
// stored biased, as c + 128 (uint8): the decode kernel multiplies them as unsigned bytes
// against signed query codes (vpdpbusd) and takes 128 * sum(query codes) back off once
// per query row. V codes are stored as int8. kernels/reference.py has the same in torch
// (quantize_kv_rows, q8_write, q8_dequantize).
#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace tw {

constexpr float kQ8Max = 127.0f;

// Address arithmetic of a q8 cache (the block table is the caller's).
struct Q8Layout {
  int64_t num_blocks, block_size, head_dim;
  int64_t block_bytes() const { return block_size * (head_dim + 4); }
  int64_t block_offset(int64_t kv_head, int64_t block) const {
    return (kv_head * num_blocks + block) * block_bytes();
  }
  // Byte offsets of row `off` of a block (from the block's start): codes, then its scale.
  int64_t codes(int64_t off) const { return off * head_dim; }
  int64_t scale(int64_t off) const { return block_size * head_dim + off * 4; }
};

// Round half to even of |x| < 2^22 (what torch.round does), without depending on the
// rounding mode a conversion instruction would use.
inline f32x16 round_even(f32x16 x) {
  const f32x16 magic = splat(12582912.0f);  // 1.5 * 2^23
  return (x + magic) - magic;
}

// Codes and scale of one row of d values (d % 16 == 0); `bias` is 128 for K, 0 for V.
// `scale` points at the row's 4 scale bytes (no alignment assumed).
template <typename T>
inline void q8_store_row(const T* x, int64_t d, uint8_t* codes, uint8_t* scale, int bias) {
  f32x16 amax = splat(0.0f);
  for (int64_t i = 0; i < d; i += kLanes) {
    const f32x16 v = load16(x + i);
    amax = vmax(amax, v < 0 ? -v : v);
  }
  const float s = hmax(amax) / kQ8Max;
  const float div = s > 0.0f ? s : 1.0f;  // an all-zero row: codes 0, scale 0
  for (int64_t i = 0; i < d; i += kLanes) {
    f32x16 c = round_even(load16(x + i) / div);
    c = c > kQ8Max ? splat(kQ8Max) : c;
    c = c < -kQ8Max ? splat(-kQ8Max) : c;
    const i32x16 u = __builtin_convertvector(c, i32x16) + bias;
    for (int k = 0; k < kLanes; ++k) codes[i + k] = static_cast<uint8_t>(u[k] & 0xFF);
  }
  std::memcpy(scale, &s, sizeof(s));
}

// 16 codes from a row as fp32 (not yet times the scale).
inline f32x16 load16_k(const uint8_t* p) {  // biased K codes
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_sub_epi32(
      _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)), _mm512_set1_epi32(128)));
#else
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  u8x16 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, i32x16) - 128, f32x16);
#endif
}

inline f32x16 load16_v(const uint8_t* p) { return load16(reinterpret_cast<const int8_t*>(p)); }

// Where rope_cache stores a token's K and V rows: a cache in the activation dtype
// [kv_heads, slots, d], or a q8 cache. `slot` counts block * block_size + offset.
template <typename T>
struct PlainKV {
  T* k;
  T* v;
  int64_t slots, d;
  bool holds(int64_t slot) const { return slot >= 0 && slot < slots; }
  void prefetch(int64_t h, int64_t slot) const {
    const char* kd = reinterpret_cast<const char*>(k + (h * slots + slot) * d);
    const char* vd = reinterpret_cast<const char*>(v + (h * slots + slot) * d);
    for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) {
      __builtin_prefetch(kd + b, 1, 3);
      __builtin_prefetch(vd + b, 1, 3);
    }
  }
  void store(int64_t h, int64_t slot, const T* kr, const T* vr) const {
    std::copy(kr, kr + d, k + (h * slots + slot) * d);
    std::copy(vr, vr + d, v + (h * slots + slot) * d);
  }
};

struct Q8KV {
  uint8_t* k;
  uint8_t* v;
  Q8Layout lay;
  bool holds(int64_t slot) const {
    return slot >= 0 && slot < lay.num_blocks * lay.block_size;
  }
  void prefetch(int64_t h, int64_t slot) const {
    const int64_t blk = lay.block_offset(h, slot / lay.block_size), off = slot % lay.block_size;
    for (uint8_t* c : {k, v}) {
      const char* p = reinterpret_cast<const char*>(c + blk + lay.codes(off));
      for (int64_t b = 0; b < lay.head_dim; b += 64) __builtin_prefetch(p + b, 1, 3);
      __builtin_prefetch(c + blk + lay.scale(off), 1, 3);
    }
  }
  template <typename T>
  void store(int64_t h, int64_t slot, const T* kr, const T* vr) const {
    const int64_t blk = lay.block_offset(h, slot / lay.block_size), off = slot % lay.block_size;
    q8_store_row(kr, lay.head_dim, k + blk + lay.codes(off), k + blk + lay.scale(off), 128);
    q8_store_row(vr, lay.head_dim, v + blk + lay.codes(off), v + blk + lay.scale(off), 0);
  }
};

}  // namespace tw
