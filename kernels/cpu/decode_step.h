// A whole decode step of a Llama model for 1 to 8 sequences, in one call: every layer's
// norm, matmuls, rope + cache write, paged attention and SiLU-mul, then the final norm
// and the LM head. It is the CPU's counterpart of a CUDA graph replay: at batch 1 an
// eager step makes ~300 calls from Python, each forking and joining the thread team;
// here one OpenMP team lives through the step and its threads meet at barriers between
// the phases, so the step costs little more than reading the weights. Layers may attend
// through sliding windows of their own (StepModel::windows): one attention plan per
// distinct window; q and k heads may be RMS-normed before rotary (StepModel::qk_norms),
// rotate in part (rotary_dim) or not at all (rope_layers).
#pragma once

#include <omp.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "elementwise.h"
#include "gguf_packed.h"
#include "gguf_quant.h"
#include "linear.h"

namespace tw {

// Rows [col0, col0 + out) of a matmul's output from a GGUF block-quantized weight (a
// Q4_K_M file stores q/k and v, gate/up and down in different types: one part each).
struct StepQPart {
  const uint8_t* w;
  QType t;
  int64_t row_bytes, out, col0;
  bool packed = false;  // tiles of 16 rows (gguf_packed.h); row_bytes: a tile's 16th
};

// One matmul's weight: x's dtype or int8 (with per-channel scales), or GGUF parts (`q`
// not empty); optional bias.
template <typename T>
struct StepLinear {
  const void* w;
  bool int8;
  const float* scale;
  const T* bias;
  int64_t in, out;
  std::vector<StepQPart> q;
};

template <typename T>
struct StepModel {
  int64_t layers, hidden, inter, heads, kv_heads, head_dim, vocab;
  float eps;
  std::vector<const T*> norms;             // 2 per layer (input, post-attention), then final
  std::vector<StepLinear<T>> linears;      // 4 per layer (qkv, o, gate_up, down), then LM head
  // per layer: [kv_heads, blocks, block_size, d] in T, or q8 (kv_q8.h); the step's C
  std::vector<void*> k_caches, v_caches;
  int64_t block_size;
  // per layer: its caches' blocks (windowed layers of a model with global layers too
  // hold only the full blocks, engine/block_manager.py HybridPool)
  std::vector<int64_t> num_blocks;
  std::vector<int64_t> windows;  // per layer, AttnShape::window (empty: every layer full)
  // per layer q's then k's RMSNorm weight [head_dim], applied to each head before rotary
  // (Qwen3); empty: none
  std::vector<const T*> qk_norms;
  bool int8_x = false;  // GGUF parts take x quantized to int8 (QPrepared)
  int64_t rotary_dim = 0;  // the dims of each head that rotate (Phi-3: fewer than head_dim)
  std::vector<int64_t> rope_layers;  // per layer 1 (rotary) or 0 (NoPE); empty: all rotary
};

inline void split(int64_t n, int tid, int nt, int64_t align, int64_t& b, int64_t& e) {
  const int64_t units = (n + align - 1) / align;
  b = std::min(n, units * tid / nt * align);
  e = std::min(n, units * (tid + 1) / nt * align);
}

// qp: the thread's own scratch for GGUF parts (each thread prepares x for itself: a few
// microseconds, no barrier).
template <typename T>
inline void step_linear(const StepLinear<T>& L, T* y, const T* x, int rows, float* xf, int tid,
                        int nt, QPrepared& qp, bool int8_x) {
  int64_t o0, o1;
  if (!L.q.empty()) {
    to_fp32(xf, x, L.in, rows, L.in);
    for (const StepQPart& P : L.q) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (P.packed) {  // x always in int8 (the model packs only where int8_x holds)
        qp.q8 = true;
        qp.xq.fill(xf, rows, L.in, q8_group(P.t));
        split(P.out / kPackRows, tid, nt, 1, o0, o1);
        packed_range(P.t, y + P.col0, L.out, qp.xq, rows, P.w, L.in,
                     L.bias ? L.bias + P.col0 : nullptr, o0, o1);
        continue;
      }
#endif
      qp.fill(P.t, xf, rows, L.in, int8_x);
      split(P.out, tid, nt, 1, o0, o1);
      qlinear_range_any(y + P.col0, L.out, x, L.in, xf, rows, qp, P.t, P.w, P.row_bytes, L.in,
                        L.bias ? L.bias + P.col0 : nullptr, o0, o1);
    }
    return;
  }
  split(L.out, tid, nt, 1, o0, o1);
  if (L.int8) {
    to_fp32(xf, x, L.in, rows, L.in);
    linear_range<int8_t, T>(y, x, L.in, xf, static_cast<const int8_t*>(L.w), L.in, L.out, rows,
                            L.scale, L.bias, o0, o1);
    return;
  }
  if (!reads_x_directly<T, T>(L.in, L.scale)) to_fp32(xf, x, L.in, rows, L.in);
  linear_range<T, T>(y, x, L.in, xf, static_cast<const T*>(L.w), L.in, L.out, rows, L.scale,
                     L.bias, o0, o1);
}

// Asks for the start of this thread's slice of L's weight, to be issued before the barrier
// ahead of L: the rows after it are asked for as the matmul goes (prefetch_w_row), so the
// stream runs on from the first row instead of waiting there for DRAM.
template <typename T>
inline void prefetch_slice(const StepLinear<T>& L, int tid, int nt) {
  int64_t o0, o1;
  const bool q = !L.q.empty();  // GGUF: the first part's slice
  split(q ? L.q[0].out : L.out, tid, nt, q && L.q[0].packed ? kPackRows : 1, o0, o1);
  const int64_t row = q ? L.q[0].row_bytes : L.in * (L.int8 ? 1 : int64_t(sizeof(T)));
  const char* p = static_cast<const char*>(q ? L.q[0].w : L.w) + o0 * row;
  const int64_t n = std::min<int64_t>(kLinearAheadBytes, (o1 - o0) * row);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 1);
}

// Where rope_cache_token stores layer l's K and V: caches of T, or q8 caches (C = uint8_t).
template <typename T, typename C>
inline auto step_kv(const StepModel<T>& m, int64_t l) {
  if constexpr (std::is_same_v<C, uint8_t>)
    return Q8KV{static_cast<uint8_t*>(m.k_caches[l]), static_cast<uint8_t*>(m.v_caches[l]),
                {m.num_blocks[l], m.block_size, m.head_dim}};
  else
    return PlainKV<T>{static_cast<T*>(m.k_caches[l]), static_cast<T*>(m.v_caches[l]),
                      m.num_blocks[l] * m.block_size, m.head_dim};
}

// The attention work of a step: one shape and plan per distinct sliding window (and cache
// size) among the layers, and which one each layer takes.
struct StepPlans {
  std::vector<AttnShape> shapes;
  std::vector<AttnPlan> plans;
  std::vector<size_t> of_layer;

  template <typename T>
  StepPlans(const StepModel<T>& m, const AttnShape& sh, const int32_t* seq_lens,
            const int32_t* qstart, int64_t num_seqs, int threads) {
    for (int64_t l = 0; l < m.layers; ++l) {
      const int64_t win = m.windows.empty() ? 0 : m.windows[l];
      size_t i = 0;
      while (i < shapes.size() &&
             (shapes[i].window != win || shapes[i].num_blocks != m.num_blocks[l]))
        ++i;
      if (i == shapes.size()) {
        shapes.push_back(sh);
        shapes.back().window = win;
        shapes.back().num_blocks = m.num_blocks[l];
        plans.emplace_back(seq_lens, qstart, num_seqs, shapes.back(), threads);
      }
      of_layer.push_back(i);
    }
  }
};

// rows: the query tokens of num_seqs sequences (qstart: each one's first row), one per
// decode, a few for a decode verifying speculative proposals or a short chunk.
// x [rows, hidden]: the embeddings in, the residual stream afterwards. logits [rows, vocab].
// C: the caches' element type (T, or uint8_t for q8 caches).
template <int ND, typename T, typename C>
void decode_step_impl(const StepModel<T>& m, T* logits, T* x, int rows, int64_t num_seqs,
                      const int64_t* positions,
                      const int64_t* slots, const int32_t* table, int64_t table_width,
                      const int32_t* seq_lens, const int32_t* qstart, const float* cos_t,
                      const float* sin_t, float attn_scale) {
  constexpr int D = ND * kLanes;
  const int64_t H = m.heads, KVH = m.kv_heads, hidden = m.hidden, I = m.inter;
  const int64_t qkv_out = (H + 2 * KVH) * D;
  const int nt = at::get_num_threads();
  AttnShape sh{H, KVH, H / KVH, D, m.block_size, m.num_blocks[0], table_width, qkv_out, H * D,
               attn_scale};
  StepPlans attn(m, sh, seq_lens, qstart, num_seqs, nt);
  std::vector<T> h(rows * hidden), qkv(rows * qkv_out), att(rows * H * D), tmp(rows * hidden),
      gu(rows * 2 * I), act(rows * I);
  std::unique_ptr<std::atomic<size_t>[]> next(new std::atomic<size_t>[m.layers]);
  for (int64_t l = 0; l < m.layers; ++l) next[l] = 0;
  int64_t widest = std::max(hidden, I);
  for (const auto& L : m.linears) widest = std::max(widest, L.in);

#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> xf(rows * widest);
    QPrepared qp;
    thread_local AttnScratch w;
    w.reserve(D);
    int64_t r0, r1;
    split(rows, tid, n, 1, r0, r1);
    int64_t c0, c1;
    split(I, tid, n, kLanes, c0, c1);
    for (int64_t l = 0; l < m.layers; ++l) {
      const StepLinear<T>* L = &m.linears[4 * l];
      for (int64_t r = r0; r < r1; ++r)  // layer 0: norm of x; then x += the last output
        rms_norm_row(h.data() + r * hidden, l == 0 ? x + r * hidden : tmp.data() + r * hidden,
                     x + r * hidden, m.norms[2 * l], hidden, m.eps, l > 0);
      prefetch_slice(L[0], tid, n);
#pragma omp barrier
      step_linear(L[0], qkv.data(), h.data(), rows, xf.data(), tid, n, qp, m.int8_x);
#pragma omp barrier
      const auto kv = step_kv<T, C>(m, l);
      if (!m.qk_norms.empty()) {  // each q and k head of this thread's rows, in place
        const T* qn = m.qk_norms[2 * l];
        const T* kn = m.qk_norms[2 * l + 1];
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t hd = 0; hd < H + KVH; ++hd) {
            T* head = qkv.data() + r * qkv_out + hd * D;
            rms_norm_row(head, head, head, hd < H ? qn : kn, D, m.eps, false);
          }
      }
      for (int64_t r = r0; r < r1; ++r)
        rope_cache_token(qkv.data() + r * qkv_out, positions[r], cos_t, sin_t, kv, slots[r], H,
                         KVH, D, m.rope_layers.empty() || m.rope_layers[l] ? m.rotary_dim : 0);
#pragma omp barrier
      AttnPlan& plan = attn.plans[attn.of_layer[l]];
      const AttnShape& lsh = attn.shapes[attn.of_layer[l]];
      run_items<ND>(plan, next[l], att.data(), qkv.data(), static_cast<const C*>(m.k_caches[l]),
                    static_cast<const C*>(m.v_caches[l]), table, seq_lens, qstart, lsh, w);
      prefetch_slice(L[1], tid, n);
#pragma omp barrier
      if (!plan.groups.empty()) {
        int64_t g0, g1;
        split(plan.groups.size(), tid, n, 1, g0, g1);
        for (int64_t g = g0; g < g1; ++g) merge_group<ND>(plan, g, att.data(), qstart, lsh);
#pragma omp barrier
      }
      step_linear(L[1], tmp.data(), att.data(), rows, xf.data(), tid, n, qp, m.int8_x);
#pragma omp barrier
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row(h.data() + r * hidden, tmp.data() + r * hidden, x + r * hidden,
                     m.norms[2 * l + 1], hidden, m.eps, true);
      prefetch_slice(L[2], tid, n);
#pragma omp barrier
      step_linear(L[2], gu.data(), h.data(), rows, xf.data(), tid, n, qp, m.int8_x);
#pragma omp barrier
      for (int r = 0; r < rows; ++r)
        silu_and_mul_row(act.data() + r * I, gu.data() + r * 2 * I, I, c0, c1);
      prefetch_slice(L[3], tid, n);
#pragma omp barrier
      step_linear(L[3], tmp.data(), act.data(), rows, xf.data(), tid, n, qp, m.int8_x);
#pragma omp barrier
    }
    for (int64_t r = r0; r < r1; ++r)
      rms_norm_row(h.data() + r * hidden, tmp.data() + r * hidden, x + r * hidden,
                   m.norms[2 * m.layers], hidden, m.eps, true);
    prefetch_slice(m.linears[4 * m.layers], tid, n);
#pragma omp barrier
    step_linear(m.linears[4 * m.layers], logits, h.data(), rows, xf.data(), tid, n, qp, m.int8_x);
  }
}

}  // namespace tw
