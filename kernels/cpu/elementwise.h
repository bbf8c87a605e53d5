// The per-token elementwise work of a Llama layer, fused so that a decode step makes a
// handful of calls per layer instead of dozens of small torch ops. Each follows
// kernels/reference.py's arithmetic, rounding to the activation dtype where the torch
// ops round (so bf16 results match them up to the order of a sum).
#pragma once

#include <ATen/Parallel.h>

#include "kv_q8.h"
#include "vec.h"

namespace tw {

// Rounding of an fp32 vector to the activation dtype and back (identity for fp32).
inline f32x16 round_to(f32x16 v, const float*) { return v; }
inline f32x16 round_to(f32x16 v, const c10::BFloat16*) {
  c10::BFloat16 tmp[kLanes];
  store16(tmp, v);
  return load16(tmp);
}

// exp(x) for any finite x (clamped to fp32's range).
inline f32x16 vexp_any(f32x16 x) {
  const f32x16 hi = splat(88.0f);
  return vexp(x > hi ? hi : x);
}

// out = weight * rmsnorm(x (+ residual)); with `add`, residual <- x + residual first (in
// the activation dtype) and the norm reads it. Rows of `hidden` elements, contiguous. A
// weight in T multiplies the norm rounded to T (HF's Llama norm); an fp32 weight (W =
// float, Gemma's 1 + w) multiplies it before the one rounding (HF's Gemma norm).
template <typename T, typename W = T>
inline void rms_norm_row(T* out, const T* xr, T* res, const W* weight, int64_t hidden, float eps,
                         bool add) {
  const T* src = add ? res : xr;
  f32x16 ss = {};
  for (int64_t i = 0; i < hidden; i += kLanes) {
    f32x16 v = load16(xr + i);
    if (add) {
      v = round_to(v + load16(res + i), xr);
      store16(res + i, v);
    }
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(hsum(ss) / float(hidden) + eps);
  for (int64_t i = 0; i < hidden; i += kLanes) {
    f32x16 h = load16(src + i) * inv;
    if constexpr (std::is_same_v<T, W>) h = round_to(h, xr);
    store16(out + i, load16(weight + i) * h);
  }
}

template <typename T, typename W = T>
void rms_norm_rows(T* out, const T* x, T* residual, const W* weight, int64_t rows,
                   int64_t hidden, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rms_norm_row(out + r * hidden, x + r * hidden, residual + r * hidden, weight, hidden, eps,
                   add);
  });
}

// Neox rotary embedding of q and k heads in place, in each row of qkv [tokens, (heads +
// 2 * kv_heads) * head_dim] (row stride `row`), then k and v of each token stored at
// its cache slot through `kv` (PlainKV or Q8KV, kv_q8.h; a slot it does not hold: not
// stored). The first `rot` dims of each head rotate (rot == d: all; fewer: Phi-3's
// partial rotary; 0: none, a NoPE layer); cos, sin: fp32 [max_positions, rot / 2].
template <typename T, typename KV>
inline void rope_cache_token(T* x, int64_t position, const float* cos_t, const float* sin_t,
                             const KV& kv, int64_t slot, int64_t heads, int64_t kv_heads,
                             int64_t d, int64_t rot) {
  const int64_t half = rot / 2;
  const float* c = cos_t + position * half;
  const float* s = sin_t + position * half;
  for (int64_t h = 0; h < heads + kv_heads; ++h) {
    T* xh = x + h * d;
    for (int64_t i = 0; i < half; i += kLanes) {
      // the tables are cast to the activation dtype first, as the reference does
      const f32x16 cv = round_to(load16(c + i), xh), sv = round_to(load16(s + i), xh);
      const f32x16 a = load16(xh + i), b = load16(xh + half + i);
      // x * cos + rotate_half(x) * sin, each product rounded as torch rounds it
      const f32x16 lo = round_to(a * cv, xh) - round_to(b * sv, xh);
      const f32x16 hi = round_to(b * cv, xh) + round_to(a * sv, xh);
      store16(xh + i, lo);
      store16(xh + half + i, hi);
    }
  }
  if (!kv.holds(slot)) return;
  for (int64_t h = 0; h < kv_heads; ++h)
    kv.store(h, slot, x + (heads + h) * d, x + (heads + kv_heads + h) * d);
}

template <typename T, typename KV>
void rope_and_cache(T* qkv, int64_t row, const int64_t* positions, const float* cos_t,
                    const float* sin_t, const KV& kv, const int64_t* slots, int64_t tokens,
                    int64_t heads, int64_t kv_heads, int64_t d) {
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    // The cache lines the tokens' K and V go to are cold (each in its own block): asked
    // for all at once, for writing, they arrive together instead of one miss after
    // another as the stores reach them (64 decodes: 3.4 ms a step before, per the
    // profiler, on 30 layers).
    for (int64_t t = t0; t < t1; ++t) {
      if (!kv.holds(slots[t])) continue;
      for (int64_t h = 0; h < kv_heads; ++h) kv.prefetch(h, slots[t]);
    }
    for (int64_t t = t0; t < t1; ++t)
      rope_cache_token(qkv + t * row, positions[t], cos_t, sin_t, kv, slots[t], heads, kv_heads,
                       d, d);
  });
}

// out [rows, d] = silu(gate) * up for x [rows, 2d] = [gate | up].
// Columns [c0, c1) of one row (c0, c1 multiples of 16).
template <typename T>
inline void silu_and_mul_row(T* out, const T* g, int64_t d, int64_t c0, int64_t c1) {
  for (int64_t i = c0; i < c1; i += kLanes) {
    const f32x16 gv = load16(g + i);
    const f32x16 silu = round_to(gv / (1.0f + vexp_any(-gv)), g);
    store16(out + i, silu * load16(g + d + i));
  }
}

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_and_mul_row(out + r * d, x + r * 2 * d, d, 0, d);
  });
}

}  // namespace tw
