// Tidewire's CPU operators, registered as torch.ops.tidewire.*: argument checks and the
// dispatch on dtype, head_dim and cache format; the kernels are the headers beside it
// (attention.h, decode_step.h, elementwise.h, linear.h). kernels/cpu_ops.py compiles
// this file with -march=native on the machine that runs it, so each header's ISA
// branches are settled by the build. The Python wrappers there document the layouts;
// torch references are in kernels/reference.py, parity tests in tests/test_cpu_ops*.py
// (decode_step's against the engine's own model, tests/test_engine_parity.py).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "attention.h"
#include "decode_step.h"
#include "elementwise.h"
#include "gguf_gemm.h"
#include "gguf_packed.h"
#include "gguf_quant.h"
#include "linear.h"

namespace tw {
namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "tidewire cpu op: ", what); }

template <typename T, int ND>
void attention_typed(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start,
                     const AttnShape& sh, const Cascade* cascade) {
  auto run = [&](const auto* kc, const auto* vc) {
    if (cascade)
      cascade_attention_impl<ND>(out.data_ptr<T>(), q.const_data_ptr<T>(), kc, vc,
                                 block_table.const_data_ptr<int32_t>(),
                                 seq_lens.const_data_ptr<int32_t>(),
                                 query_start.const_data_ptr<int32_t>(), seq_lens.size(0), sh,
                                 *cascade);
    else
      paged_attention_impl<ND>(out.data_ptr<T>(), q.const_data_ptr<T>(), kc, vc,
                               block_table.const_data_ptr<int32_t>(),
                               seq_lens.const_data_ptr<int32_t>(),
                               query_start.const_data_ptr<int32_t>(), seq_lens.size(0), sh);
  };
  if (k_cache.scalar_type() == at::kByte)
    run(k_cache.const_data_ptr<uint8_t>(), v_cache.const_data_ptr<uint8_t>());
  else
    run(k_cache.const_data_ptr<T>(), v_cache.const_data_ptr<T>());
}

// The block size of a q8 cache [kv_heads, blocks, block_size * (head_dim + 4)] (kv_q8.h).
int64_t q8_block_size(const at::Tensor& cache, int64_t d) {
  check(cache.dim() == 3 && cache.size(2) % (d + 4) == 0,
        "an int8 (q8) cache must be uint8 [kv_heads, blocks, block_size * (head_dim + 4)]");
  return cache.size(2) / (d + 4);
}

template <typename T>
void attention_by_dim(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& bt, const at::Tensor& sl,
                      const at::Tensor& qs, const AttnShape& sh, const Cascade* c) {
  switch (sh.head_dim % kLanes == 0 ? sh.head_dim / kLanes : 0) {
    case 1: return attention_typed<T, 1>(out, q, k, v, bt, sl, qs, sh, c);
    case 2: return attention_typed<T, 2>(out, q, k, v, bt, sl, qs, sh, c);
    case 4: return attention_typed<T, 4>(out, q, k, v, bt, sl, qs, sh, c);
    case 5: return attention_typed<T, 5>(out, q, k, v, bt, sl, qs, sh, c);
    case 6: return attention_typed<T, 6>(out, q, k, v, bt, sl, qs, sh, c);
    case 8: return attention_typed<T, 8>(out, q, k, v, bt, sl, qs, sh, c);
    case 16: return attention_typed<T, 16>(out, q, k, v, bt, sl, qs, sh, c);
    default: check(false, "head_dim must be 16, 32, 64, 80, 96, 128 or 256");
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                     int64_t num_decodes, int64_t window,
                     const std::optional<at::Tensor>& cascade_members,
                     const std::optional<at::Tensor>& cascade_offsets,
                     const std::optional<at::Tensor>& cascade_shared) {
  check(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, heads, head_dim]");
  const bool q8 = k_cache.scalar_type() == at::kByte;
  check(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
            (q8 || k_cache.dim() == 4),
        "caches must be [kv_heads, blocks, block_size, head_dim] (or q8), alike");
  const int64_t d = q.size(2);
  const int64_t bs = q8 ? q8_block_size(k_cache, d) : k_cache.size(2);
  check(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  check(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
            out.stride(1) == out.size(2),
        "q and out need contiguous heads (the token stride may be anything)");
  check((q8 || q.scalar_type() == k_cache.scalar_type()) && out.scalar_type() == q.scalar_type(),
        "q, out and the caches must share a dtype (or the caches be q8)");
  check(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
            query_start.scalar_type() == at::kInt && block_table.is_contiguous() &&
            seq_lens.is_contiguous() && query_start.is_contiguous(),
        "block_table, seq_lens and query_start must be contiguous int32");
  check(query_start.size(0) == seq_lens.size(0) + 1 && block_table.size(0) >= seq_lens.size(0),
        "query_start must have num_seqs + 1 entries, block_table num_seqs rows");
  {
    const int32_t* qs = query_start.const_data_ptr<int32_t>();
    const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
    check(qs[0] == 0 && qs[seq_lens.size(0)] == q.size(0), "query_start must run 0..num_tokens");
    for (int64_t s = 0; s < seq_lens.size(0); ++s)
      check(qs[s + 1] >= qs[s] && sl[s] >= qs[s + 1] - qs[s] &&
                (sl[s] + bs - 1) / bs <= block_table.size(1),
            "each sequence's context must hold its queries and fit its block-table row");
  }
  const int64_t heads = q.size(1), kvh = k_cache.size(0);
  check((q8 || k_cache.size(3) == d) && heads % kvh == 0, "head_dim or GQA group mismatch");
  AttnShape sh{heads, kvh, heads / kvh, d, bs, k_cache.size(1),
               block_table.size(1), q.stride(0), out.stride(0), static_cast<float>(scale)};
  check(sh.group <= kMaxRows, "GQA group too large");
  if (num_decodes >= 0) sh.num_decodes = num_decodes;
  check(window >= 0 && window <= std::numeric_limits<int32_t>::max(),
        "window must be 0 (full causal attention) or a positive number of keys");
  sh.window = window;
  Cascade cas{};
  const bool cascade = cascade_members.has_value();
  if (cascade) {
    check(cascade_offsets.has_value() && cascade_shared.has_value(),
          "cascade needs members, offsets and shared key counts");
    const at::Tensor& mem = *cascade_members;
    const at::Tensor& off = *cascade_offsets;
    const at::Tensor& shr = *cascade_shared;
    check(mem.scalar_type() == at::kInt && off.scalar_type() == at::kInt &&
              shr.scalar_type() == at::kInt && mem.is_contiguous() && off.is_contiguous() &&
              shr.is_contiguous() && off.dim() == 1 && off.size(0) == shr.size(0) + 1,
          "cascade: contiguous int32 members, offsets [groups + 1], shared [groups]");
    check(window == 0, "cascade: full causal attention only (no sliding window)");
    cas = Cascade{mem.const_data_ptr<int32_t>(), off.const_data_ptr<int32_t>(),
                  shr.const_data_ptr<int32_t>(), shr.size(0)};
    const int32_t* qs = query_start.const_data_ptr<int32_t>();
    const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
    const int32_t* bt = block_table.const_data_ptr<int32_t>();
    const int64_t n = seq_lens.size(0), width = block_table.size(1);
    std::vector<bool> seen(n, false);
    check(cas.offsets[0] == 0 && cas.offsets[cas.groups] == mem.numel(),
          "cascade: offsets must run 0..len(members)");
    for (int64_t g = 0; g < cas.groups; ++g) {
      const int32_t lo = cas.offsets[g], hi = cas.offsets[g + 1], keys = cas.shared[g];
      check(hi > lo && keys >= 0, "cascade: every group has members and shared keys >= 0");
      const int32_t first = cas.members[lo];
      for (int32_t i = lo; i < hi; ++i) {
        const int32_t s = cas.members[i];
        check(s >= 0 && s < n && !seen[s], "cascade: members are distinct sequences");
        seen[s] = true;
        check(keys <= sl[s] - (qs[s + 1] - qs[s]),
              "cascade: shared keys must lie before every query of their members");
        check(std::equal(bt + int64_t(s) * width, bt + int64_t(s) * width + (keys + bs - 1) / bs,
                         bt + int64_t(first) * width),
              "cascade: members must share the blocks of their shared keys");
      }
    }
  }
  const Cascade* c = cascade ? &cas : nullptr;
  if (q.scalar_type() == at::kFloat)
    attention_by_dim<float>(out, q, k_cache, v_cache, block_table, seq_lens, query_start, sh, c);
  else if (q.scalar_type() == at::kBFloat16)
    attention_by_dim<c10::BFloat16>(out, q, k_cache, v_cache, block_table, seq_lens, query_start,
                                    sh, c);
  else
    check(false, "dtype must be float32 or bfloat16");
}

void check_rows(const at::Tensor& t, int64_t width, const char* what) {
  check(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1 && t.stride(0) == width, what);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
              double eps, bool add) {
  const int64_t hidden = weight.size(0), rows = x.size(0);
  check(hidden % kLanes == 0, "hidden size must be a multiple of 16");
  check_rows(out, hidden, "out must be contiguous [rows, hidden]");
  check_rows(x, hidden, "x must be contiguous [rows, hidden]");
  check_rows(residual, hidden, "residual must be contiguous [rows, hidden]");
  check(out.size(0) == rows && residual.size(0) == rows && weight.is_contiguous() &&
            x.scalar_type() == out.scalar_type() && x.scalar_type() == residual.scalar_type() &&
            (x.scalar_type() == weight.scalar_type() || weight.scalar_type() == at::kFloat),
        "rms_norm: shapes or dtypes disagree (the weight: x's dtype or float32)");
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat)
    rms_norm_rows<c10::BFloat16, float>(
        out.data_ptr<c10::BFloat16>(), x.const_data_ptr<c10::BFloat16>(),
        residual.data_ptr<c10::BFloat16>(), weight.const_data_ptr<float>(), rows, hidden,
        float(eps), add);
  else if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(out.data_ptr<float>(), x.const_data_ptr<float>(),
                         residual.data_ptr<float>(), weight.const_data_ptr<float>(), rows, hidden,
                         float(eps), add);
  else if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.const_data_ptr<c10::BFloat16>(),
                                 residual.data_ptr<c10::BFloat16>(),
                                 weight.const_data_ptr<c10::BFloat16>(), rows, hidden, float(eps),
                                 add);
  else
    check(false, "dtype must be float32 or bfloat16");
}

template <typename T>
void rope_cache_typed(at::Tensor& qkv, const at::Tensor& pos, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                      const at::Tensor& slots, int64_t heads, int64_t kvh, int64_t d) {
  auto run = [&](const auto& kv) {
    rope_and_cache<T>(qkv.data_ptr<T>(), qkv.stride(0), pos.const_data_ptr<int64_t>(),
                      cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), kv,
                      slots.const_data_ptr<int64_t>(), qkv.size(0), heads, kvh, d);
  };
  if (kc.scalar_type() == at::kByte)
    run(Q8KV{kc.data_ptr<uint8_t>(), vc.data_ptr<uint8_t>(),
             {kc.size(1), q8_block_size(kc, d), d}});
  else
    run(PlainKV<T>{kc.data_ptr<T>(), vc.data_ptr<T>(), kc.size(1) * kc.size(2), d});
}

void rope_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                const at::Tensor& slot_mapping, int64_t num_heads) {
  const int64_t kvh = k_cache.size(0);
  const bool q8 = k_cache.scalar_type() == at::kByte;
  check(qkv.dim() == 2 && qkv.size(1) % (num_heads + 2 * kvh) == 0,
        "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows");
  const int64_t d = qkv.size(1) / (num_heads + 2 * kvh);
  check(d % (2 * kLanes) == 0, "head_dim must be a multiple of 32");
  check(qkv.stride(1) == 1 && (q8 || k_cache.size(3) == d),
        "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows");
  check(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
            k_cache.scalar_type() == v_cache.scalar_type(),
        "caches must be contiguous [kv_heads, blocks, block_size, head_dim] (or q8), alike");
  check(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
            positions.is_contiguous() && slot_mapping.is_contiguous() &&
            positions.size(0) == qkv.size(0) && slot_mapping.size(0) == qkv.size(0),
        "positions and slot_mapping must be contiguous int64 [tokens]");
  check(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
            sin.is_contiguous() && cos.size(1) == d / 2,
        "cos and sin must be contiguous fp32 [max_positions, head_dim / 2]");
  check(q8 || qkv.scalar_type() == k_cache.scalar_type(),
        "qkv and the caches must share a dtype (or the caches be q8)");
  if (qkv.scalar_type() == at::kFloat)
    rope_cache_typed<float>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                            kvh, d);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_cache_typed<c10::BFloat16>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                    num_heads, kvh, d);
  else
    check(false, "dtype must be float32 or bfloat16");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const int64_t d = out.size(1);
  check(d % kLanes == 0, "intermediate size must be a multiple of 16");
  check_rows(x, 2 * d, "x must be contiguous [rows, 2 * d]");
  check_rows(out, d, "out must be contiguous [rows, d]");
  check(x.scalar_type() == out.scalar_type() && x.size(0) == out.size(0), "silu_and_mul: shapes");
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_rows<float>(out.data_ptr<float>(), x.const_data_ptr<float>(), x.size(0), d);
  else if (x.scalar_type() == at::kBFloat16)
    silu_and_mul_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(),
                                     x.const_data_ptr<c10::BFloat16>(), x.size(0), d);
  else
    check(false, "dtype must be float32 or bfloat16");
}

template <typename T>
void linear_small_by_weight(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                            const float* scale, const T* bias) {
  const int64_t in = w.size(1), o = w.size(0), rows = x.size(0);
  T* y = out.data_ptr<T>();
  const T* xp = x.const_data_ptr<T>();
  if (w.scalar_type() == at::kChar)
    linear_small_any<int8_t, T>(y, xp, x.stride(0), w.const_data_ptr<int8_t>(), in, o, rows, scale, bias);
  else if (w.scalar_type() == x.scalar_type())
    linear_small_any<T, T>(y, xp, x.stride(0), w.const_data_ptr<T>(), in, o, rows, scale, bias);
  else
    check(false, "linear_small: the weight must be int8 or x's dtype");
}

void linear_small(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), in = w.size(1);
  check(x.dim() == 2 && w.dim() == 2 && x.size(1) == in && x.stride(1) == 1 && w.is_contiguous(),
        "linear_small: x [rows, in] with contiguous rows, w contiguous [out, in]");
  check(rows >= 1 && rows <= kMaxLinearRows, "linear_small takes 1 to 8 rows");
  check(in % kLanes == 0, "linear_small: in_features must be a multiple of 16");
  check_rows(out, w.size(0), "out must be contiguous [rows, out]");
  check(out.size(0) == rows && out.scalar_type() == x.scalar_type(), "linear_small: out shape");
  const float* sp = nullptr;
  if (scale.has_value()) {
    check(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == w.size(0),
          "linear_small: scale must be fp32 [out]");
    sp = scale->const_data_ptr<float>();
  }
  if (bias.has_value())
    check(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == w.size(0),
          "linear_small: bias must be [out] in x's dtype");
  if (x.scalar_type() == at::kFloat)
    linear_small_by_weight<float>(out, x, w, sp, bias ? bias->const_data_ptr<float>() : nullptr);
  else if (x.scalar_type() == at::kBFloat16)
    linear_small_by_weight<c10::BFloat16>(
        out, x, w, sp, bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
  else
    check(false, "dtype must be float32 or bfloat16");
}

// y = x (q s)^T (+ bias) for bf16 x with any number of rows and int8 weights q [out, in] with
// fp32 scales s [out] (`--quantization int8`), on the integer GEMM (gguf_gemm.h), where
// gguf_gemm_int8 says it runs for Q8_0 rows of `in` values.
void linear_int8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), in = q.size(1), o = q.size(0);
  check(qgemm_int8_reads(QType::Q8_0, in), "linear_int8_gemm: needs AVX-512 VNNI and BF16, in % 256 == 0");
  check(x.dim() == 2 && x.size(1) == in && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
        "linear_int8_gemm: x bf16 [rows, in] with unit column stride");
  check(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar, "linear_int8_gemm: q int8 [out, in]");
  check(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == o,
        "linear_int8_gemm: scale must be fp32 [out]");
  check(out.dim() == 2 && out.size(0) == rows && out.size(1) == o && out.stride(1) == 1 &&
            out.scalar_type() == at::kBFloat16,
        "linear_int8_gemm: out bf16 [rows, out], unit column stride");
  if (bias.has_value())
    check(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == o,
          "linear_int8_gemm: bias must be bf16 [out]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  linear_int8_rows(out.data_ptr<c10::BFloat16>(), out.stride(0), xf.const_data_ptr<float>(), rows,
                   q.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), in, o,
                   bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
}

// y = x W^T (+ bias) for 1-8 rows of x and a GGUF block-quantized W (gguf_quant.h);
// `out` may be a column slice of a wider output (rows of stride out.stride(0)).
void gguf_linear_small(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       const c10::optional<at::Tensor>& bias, bool int8_x) {
  check(qtype_known(qtype), "gguf_linear_small: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  const QType t = QType(qtype);
  const QTypeInfo info = qtype_info(t);
  const int64_t rows = x.size(0), in = x.size(1), o = w.size(0);
  check(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() &&
            w.scalar_type() == at::kByte && in % info.block_values == 0 &&
            w.size(1) == in / info.block_values * info.block_bytes,
        "gguf_linear_small: x [rows, in] (in a multiple of the block), w uint8 [out, row bytes]");
  check(rows >= 1 && rows <= kMaxLinearRows, "gguf_linear_small takes 1 to 8 rows");
  check(out.dim() == 2 && out.size(0) == rows && out.size(1) == o && out.stride(1) == 1 &&
            out.scalar_type() == x.scalar_type(),
        "gguf_linear_small: out [rows, out] in x's dtype, unit column stride");
  if (bias.has_value())
    check(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == o,
          "gguf_linear_small: bias must be [out] in x's dtype");
  std::vector<float> xf(rows * in);
  auto run = [&](auto* y, const auto* xp, const auto* bp) {
    to_fp32(xf.data(), xp, x.stride(0), rows, in);
    qlinear_small_any(y, out.stride(0), xp, x.stride(0), xf.data(), int(rows), t,
                      w.const_data_ptr<uint8_t>(), w.size(1), in, o, bp, int8_x);
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>(), x.const_data_ptr<float>(),
        bias ? bias->const_data_ptr<float>() : nullptr);
  else if (x.scalar_type() == at::kBFloat16)
    run(out.data_ptr<c10::BFloat16>(), x.const_data_ptr<c10::BFloat16>(),
        bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
  else
    check(false, "dtype must be float32 or bfloat16");
}

// Whether gguf_pack takes type qtype on this CPU (Q4_K, Q6_K; AVX-512 VNNI: gguf_packed.h).
bool gguf_packs(int64_t qtype) { return qtype_known(qtype) && packs(QType(qtype)); }

// out uint8 [rows / 16, in / 256, tile bytes] = w's Q4_K or Q6_K rows [rows, row bytes]
// as tiles (gguf_packed.h).
void gguf_pack(at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  check(gguf_packs(qtype), "gguf_pack takes Q4_K, Q6_K or Q8_0 on a CPU with AVX-512 VNNI");
  const QType t = QType(qtype);
  const int64_t bb = qtype_info(t).block_bytes * (t == QType::Q8_0 ? 8 : 1), tb = pack_tile_bytes(t);
  check(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte && w.size(1) % bb == 0 &&
            w.size(0) % kPackRows == 0,
        "gguf_pack: w uint8 [rows (a multiple of 16), row bytes] of whole blocks");
  const int64_t tiles = w.size(0) / kPackRows, nb = w.size(1) / bb;
  check(out.dim() == 3 && out.is_contiguous() && out.scalar_type() == at::kByte &&
            out.size(0) == tiles && out.size(1) == nb && out.size(2) == tb,
        "gguf_pack: out uint8 [rows / 16, in / 256, tile bytes]");
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i)
      for (int64_t b = 0; b < nb; ++b)
        pack_tile(t, src + i * kPackRows * row_bytes + b * bb, row_bytes, dst + (i * nb + b) * tb);
  });
}

// gguf_pack's inverse: out uint8 [rows, row bytes] of blocks from the tiles.
void gguf_unpack(at::Tensor& out, const at::Tensor& packed, int64_t qtype) {
  check(gguf_packs(qtype), "gguf_unpack takes Q4_K, Q6_K or Q8_0 on a CPU with AVX-512 VNNI");
  const QType t = QType(qtype);
  const int64_t bb = qtype_info(t).block_bytes * (t == QType::Q8_0 ? 8 : 1), tb = pack_tile_bytes(t);
  check(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
            packed.size(2) == tb,
        "gguf_unpack: packed uint8 [rows / 16, in / 256, tile bytes]");
  const int64_t tiles = packed.size(0), nb = packed.size(1);
  check(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kByte &&
            out.size(0) == tiles * kPackRows && out.size(1) == nb * bb,
        "gguf_unpack: out uint8 [rows, row bytes]");
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i)
      for (int64_t b = 0; b < nb; ++b)
        unpack_tile(t, src + (i * nb + b) * tb, dst + i * kPackRows * nb * bb + b * bb, nb * bb);
  });
}

// y = x W^T (+ bias) for any number of rows of x and W packed by gguf_pack (x quantized to
// int8 per 256 values, as gguf_linear_small's int8_x); `out` may be a column slice.
void gguf_packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        int64_t qtype, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  check(gguf_packs(qtype), "gguf_packed_linear takes Q4_K, Q6_K or Q8_0");
  const QType t = QType(qtype);
  check(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
            packed.size(2) == pack_tile_bytes(t),
        "gguf_packed_linear: packed uint8 [rows / 16, in / 256, tile bytes]");
  const int64_t rows = x.size(0), in = x.size(1), tiles = packed.size(0), o = tiles * kPackRows;
  check(x.dim() == 2 && x.stride(1) == 1 && in == packed.size(1) * 256,
        "gguf_packed_linear: x [rows, in] with in = 256 x the tiles' block columns");
  check(out.dim() == 2 && out.size(0) == rows && out.size(1) == o && out.stride(1) == 1 &&
            out.scalar_type() == x.scalar_type(),
        "gguf_packed_linear: out [rows, out] in x's dtype, unit column stride");
  if (bias.has_value())
    check(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == o,
          "gguf_packed_linear: bias must be [out] in x's dtype");
  if (rows == 0) return;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && rows > kPackGemmRows) {  // batches: the integer GEMM
    packed_gemm(t, out.data_ptr<c10::BFloat16>(), out.stride(0), xf.const_data_ptr<float>(), rows,
                packed.const_data_ptr<uint8_t>(), in, o,
                bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
    return;
  }
#endif
  XQ xq;
  xq.fill(xf.const_data_ptr<float>(), int(rows), in, q8_group(t));
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  auto run = [&](auto* y, const auto* bp) {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      packed_range(t, y, out.stride(0), xq, int(rows), w, in, bp, t0, t1);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>(), bias ? bias->const_data_ptr<float>() : nullptr);
  else if (x.scalar_type() == at::kBFloat16)
    run(out.data_ptr<c10::BFloat16>(), bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
  else
    check(false, "dtype must be float32 or bfloat16");
#else
  (void)out, (void)x, (void)packed, (void)qtype, (void)bias;
  check(false, "gguf_packed_linear needs a CPU with AVX-512 VNNI");
#endif
}

// Whether gguf_linear_tiled with int8_x multiplies type qtype (rows of `in` values) on
// the integer GEMM (gguf_gemm.h): AVX-512 VNNI and BF16, `in` a multiple of 256, and not
// where AMX runs.
bool gguf_gemm_int8(int64_t qtype, int64_t in) {
  check(qtype_known(qtype), "gguf_gemm_int8: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
#if defined(TW_AMX)
  if (amx_on()) return false;
#endif
  return qgemm_int8_reads(QType(qtype), in);
}

// y = x W^T (+ bias) for bf16 x with any number of rows and a GGUF block-quantized W,
// through cache-sized dequantized tiles (qlinear_tiled); CPUs with AVX512-BF16 only.
void gguf_linear_tiled(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       const c10::optional<at::Tensor>& bias, bool int8_x) {
#if defined(__AVX512BF16__)
  check(qtype_known(qtype), "gguf_linear_tiled: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  const QType t = QType(qtype);
  const QTypeInfo info = qtype_info(t);
  const int64_t rows = x.size(0), in = x.size(1), o = w.size(0);
  check(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && w.dim() == 2 &&
            w.is_contiguous() && w.scalar_type() == at::kByte && in % info.block_values == 0 &&
            w.size(1) == in / info.block_values * info.block_bytes,
        "gguf_linear_tiled: x bf16 [rows, in] (in a multiple of the block), w uint8 [out, row bytes]");
  check(out.dim() == 2 && out.size(0) == rows && out.size(1) == o && out.stride(1) == 1 &&
            out.scalar_type() == at::kBFloat16,
        "gguf_linear_tiled: out bf16 [rows, out], unit column stride");
  if (bias.has_value())
    check(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == o,
          "gguf_linear_tiled: bias must be bf16 [out]");
  if (int8_x && gguf_gemm_int8(qtype, in)) {  // the integer GEMM (gguf_gemm.h)
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    qlinear_int8(out.data_ptr<c10::BFloat16>(), out.stride(0), xf.const_data_ptr<float>(), rows, t,
                 w.const_data_ptr<uint8_t>(), w.size(1), in, o,
                 bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
    return;
  }
  qlinear_tiled(out.data_ptr<c10::BFloat16>(), out.stride(0), x.const_data_ptr<c10::BFloat16>(),
                x.stride(0), rows, t, w.const_data_ptr<uint8_t>(), w.size(1), in, o,
                bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr);
#else
  (void)out, (void)x, (void)w, (void)qtype, (void)bias, (void)int8_x;
  check(false, "gguf_linear_tiled needs a CPU with AVX512-BF16");
#endif
}

// Whether the kernels use AMX (the CPU has it, the compiler targeted it and this process
// was granted its tile state); allow = 0 or 1 turns its use off or back on first (-1 asks).
// Whether gguf_linear_small, asked for int8 x, multiplies x as int8 for weights of type
// `qtype` with rows of `in` values on this CPU (gguf_quant.h qreads_q8).
bool gguf_reads_int8(int64_t qtype, int64_t in) {
  check(qtype_known(qtype), "gguf_reads_int8: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  return qreads_q8(QType(qtype), in);
}

// How many values of a row of x share one int8 scale where gguf_linear_small (int8_x) and
// gguf_packed_linear quantize x for type qtype on this CPU (gguf_quant.h q8_group).
int64_t gguf_x_group(int64_t qtype) {
  check(qtype_known(qtype), "gguf_x_group: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  return q8_group(QType(qtype));
}

bool cpu_amx(int64_t allow) {
  if (allow >= 0) amx_allowed() = allow != 0;
#if defined(TW_AMX)
  return amx_allowed() && amx_ready();
#else
  return false;
#endif
}

// The values of GGUF block-quantized rows: w uint8 [n, row bytes] -> out [n, in].
void gguf_dequant(at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  check(qtype_known(qtype), "gguf_dequant: type must be Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
  const QType t = QType(qtype);
  const QTypeInfo info = qtype_info(t);
  const int64_t n = w.size(0), in = out.size(1);
  check(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte && out.dim() == 2 &&
            out.is_contiguous() && out.size(0) == n && in % info.block_values == 0 &&
            w.size(1) == in / info.block_values * info.block_bytes,
        "gguf_dequant: w uint8 [n, row bytes], out contiguous [n, in]");
  if (out.scalar_type() == at::kFloat)
    dequant_rows(t, w.const_data_ptr<uint8_t>(), w.size(1), n, in, out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16)
    dequant_rows(t, w.const_data_ptr<uint8_t>(), w.size(1), n, in, out.data_ptr<c10::BFloat16>());
  else
    check(false, "gguf_dequant: out must be float32 or bfloat16");
}

template <typename T>
StepModel<T> step_model(const at::TensorList norms, const at::TensorList linears,
                        const c10::List<c10::optional<at::Tensor>>& scales,
                        const c10::List<c10::optional<at::Tensor>>& biases,
                        const at::TensorList k_caches, const at::TensorList v_caches,
                        int64_t num_heads, double eps, at::IntArrayRef windows,
                        const at::TensorList qk_norms, int64_t rotary_dim,
                        at::IntArrayRef rope_layers, at::IntArrayRef part_counts,
                        at::IntArrayRef qtypes) {
  const int64_t layers = k_caches.size();
  const size_t matmuls = scales.size();
  check(layers >= 1 && v_caches.size() == size_t(layers) && norms.size() == size_t(2 * layers + 1) &&
            matmuls == size_t(4 * layers + 1) && biases.size() == matmuls,
        "decode_step: 2L+1 norms, 4L+1 matmuls (scales, biases alike) and L caches");
  size_t parts = 0;
  for (const int64_t c : part_counts) {
    check(c >= 1, "decode_step: every matmul has a part");
    parts += size_t(c);
  }
  check(part_counts.empty() ? linears.size() == matmuls
                            : part_counts.size() == matmuls && parts == linears.size(),
        "decode_step: one linear a matmul, or part_counts of them");
  check(qtypes.empty() || qtypes.size() == linears.size(),
        "decode_step: qtypes must be empty or one per linear");
  const at::ScalarType act = norms[0].scalar_type();
  StepModel<T> m;
  size_t k = 0;  // linears[k]: the next part
  for (size_t i = 0; i < matmuls; ++i) {
    const int64_t n = part_counts.empty() ? 1 : part_counts[i];
    const c10::optional<at::Tensor> sc = scales.get(i), b = biases.get(i);
    StepLinear<T> L{nullptr, false, nullptr, b ? b->const_data_ptr<T>() : nullptr, 0, 0, {}};
    if (n == 1 && (qtypes.empty() || qtypes[k] == 0)) {  // a plain or int8 weight [out, in]
      const at::Tensor& w = linears[k++];
      L.int8 = w.scalar_type() == at::kChar;
      check(w.dim() == 2 && w.is_contiguous() && (L.int8 || w.scalar_type() == act) &&
                w.size(1) % kLanes == 0,
            "decode_step: linear weights must be contiguous [out, in], in % 16 == 0, int8 or "
            "the activations' dtype");
      check(L.int8 == sc.has_value(), "decode_step: int8 weights come with scales, others without");
      L.w = w.const_data_ptr();
      L.scale = sc ? sc->const_data_ptr<float>() : nullptr;
      L.in = w.size(1);
      L.out = w.size(0);
    } else {  // GGUF block parts, stacked by rows
      check(!sc.has_value(), "decode_step: GGUF weights take no scales");
      for (int64_t j = 0; j < n; ++j, ++k) {
        const at::Tensor& w = linears[k];
        const int64_t qt = qtypes.empty() ? 0 : qtypes[k];
        if (qt == kPackedQ4K || qt == kPackedQ6K || qt == kPackedQ8) {  // tiles (gguf_packed.h)
          const QType pt = QType(qt - 256);
          const int64_t tb = pack_tile_bytes(pt);
          check(packs(pt) && w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte &&
                    w.size(2) == tb && (j == 0 || w.size(1) * 256 == L.in),
                "decode_step: packed parts are uint8 [rows / 16, in / 256, tile bytes] on a CPU "
                "with AVX-512 VNNI");
          L.in = w.size(1) * 256;
          StepQPart P{w.const_data_ptr<uint8_t>(), pt, w.size(1) * tb / kPackRows,
                      w.size(0) * kPackRows, L.out};
          P.packed = true;
          L.q.push_back(P);
          L.out += P.out;
          continue;
        }
        check(qtype_known(qt) && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "decode_step: the parts of a GGUF matmul are uint8 [out, row bytes] blocks of "
              "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K");
        const QTypeInfo info = qtype_info(QType(qt));
        const int64_t in = w.size(1) / info.block_bytes * info.block_values;
        check(w.size(1) % info.block_bytes == 0 && (j == 0 || in == L.in),
              "decode_step: a GGUF matmul's parts take one input width in whole blocks");
        L.in = in;
        L.q.push_back({w.const_data_ptr<uint8_t>(), QType(qt), w.size(1), w.size(0), L.out});
        L.out += w.size(0);
      }
    }
    check(!b || (b->numel() == L.out && b->is_contiguous() && b->scalar_type() == act) ,
          "decode_step: biases [out] in the activations' dtype");
    check(!sc || (sc->numel() == L.out && sc->is_contiguous() && sc->scalar_type() == at::kFloat),
          "decode_step: scales [out] fp32");
    m.linears.push_back(std::move(L));
  }
  const at::Tensor& k0 = k_caches[0];
  const bool q8 = k0.scalar_type() == at::kByte;
  m.layers = layers;
  m.hidden = norms[0].numel();
  m.heads = num_heads;
  m.kv_heads = k0.size(0);
  m.head_dim = q8 ? m.linears[1].in / num_heads : k0.size(3);
  m.block_size = q8 ? q8_block_size(k0, m.head_dim) : k0.size(2);
  m.inter = m.linears[3].in;
  m.vocab = m.linears[4 * layers].out;
  m.eps = float(eps);
  check(windows.empty() || int64_t(windows.size()) == layers,
        "decode_step: windows must be empty or one per layer");
  for (const int64_t win : windows)
    check(win >= 0 && win <= std::numeric_limits<int32_t>::max(),
          "decode_step: a window must be 0 (full attention) or a positive number of keys");
  m.windows.assign(windows.begin(), windows.end());
  m.rotary_dim = rotary_dim ? rotary_dim : m.head_dim;
  check(m.rotary_dim % (2 * kLanes) == 0 && m.rotary_dim <= m.head_dim,
        "decode_step: rotary_dim must be a multiple of 32, at most head_dim");
  check(rope_layers.empty() || int64_t(rope_layers.size()) == layers,
        "decode_step: rope_layers must be empty or one per layer");
  m.rope_layers.assign(rope_layers.begin(), rope_layers.end());
  check(qk_norms.empty() || int64_t(qk_norms.size()) == 2 * layers,
        "decode_step: qk_norms must be empty or two per layer (q's, then k's)");
  for (const auto& t : qk_norms) {
    check(t.scalar_type() == act && t.is_contiguous() && t.numel() == m.head_dim,
          "decode_step: q/k norm weights [head_dim] in the activations' dtype");
    m.qk_norms.push_back(t.const_data_ptr<T>());
  }
  for (const auto& t : norms) {
    check(t.scalar_type() == act && t.is_contiguous() && t.numel() == m.hidden,
          "decode_step: norm weights");
    m.norms.push_back(t.const_data_ptr<T>());
  }
  for (int64_t l = 0; l < layers; ++l) {
    // alike but for their blocks (a windowed layer may hold fewer: HybridPool)
    const auto alike = [&](const at::Tensor& c) {
      return c.dim() == k0.dim() && c.size(0) == k0.size(0) &&
             c.sizes().slice(2) == k0.sizes().slice(2) && c.size(1) == k_caches[l].size(1);
    };
    check(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() && alike(k_caches[l]) &&
              alike(v_caches[l]) &&
              k_caches[l].scalar_type() == k0.scalar_type() &&
              v_caches[l].scalar_type() == k0.scalar_type() && (q8 || k0.scalar_type() == act),
          "decode_step: caches alike, in the activations' dtype or q8");
    m.num_blocks.push_back(k_caches[l].size(1));
    m.k_caches.push_back(k_caches[l].data_ptr());
    m.v_caches.push_back(v_caches[l].data_ptr());
  }
  const int64_t d = m.head_dim;
  check(num_heads % m.kv_heads == 0 && num_heads / m.kv_heads <= kMaxRows,
        "decode_step: heads must be a multiple of kv_heads, at most 64 per group");
  for (int64_t l = 0; l < layers; ++l)  // every layer like layer 0
    for (int64_t j = 0; j < 4; ++j)
      check(m.linears[4 * l + j].in == m.linears[j].in &&
                m.linears[4 * l + j].out == m.linears[j].out,
            "decode_step: every layer's weights shaped like layer 0's");
  const auto& L = m.linears;
  check(L[0].out == (num_heads + 2 * m.kv_heads) * d && L[0].in == m.hidden &&
            L[1].in == num_heads * d && L[1].out == m.hidden && L[2].in == m.hidden &&
            L[2].out == 2 * m.inter && L[3].out == m.hidden && L[4 * layers].in == m.hidden &&
            d % (2 * kLanes) == 0 && m.hidden % kLanes == 0 && m.inter % kLanes == 0,
        "decode_step: layer shapes");
  return m;
}

template <int ND, typename T, typename C>
void decode_step_with(at::Tensor& logits, at::Tensor& x, const at::Tensor& positions,
                      const at::Tensor& slots, const at::Tensor& table, const at::Tensor& seq_lens,
                      const at::Tensor& qstart, const at::Tensor& cos, const at::Tensor& sin,
                      const StepModel<T>& m, double scale, int rows) {
  decode_step_impl<ND, T, C>(
      m, logits.data_ptr<T>(), x.data_ptr<T>(), rows, seq_lens.size(0),
      positions.const_data_ptr<int64_t>(),
      slots.const_data_ptr<int64_t>(), table.const_data_ptr<int32_t>(), table.size(1),
      seq_lens.const_data_ptr<int32_t>(), qstart.const_data_ptr<int32_t>(),
      cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), float(scale));
}

template <typename T>
void decode_step_typed(at::Tensor& logits, at::Tensor& x, const at::Tensor& positions,
                       const at::Tensor& slots, const at::Tensor& table, const at::Tensor& seq_lens,
                       const at::Tensor& qstart, const at::Tensor& cos, const at::Tensor& sin,
                       const StepModel<T>& m, double scale, bool q8) {
  const int rows = static_cast<int>(x.size(0));
  auto run = [&](auto nd) {
    if (q8) return decode_step_with<decltype(nd)::value, T, uint8_t>(
        logits, x, positions, slots, table, seq_lens, qstart, cos, sin, m, scale, rows);
    decode_step_with<decltype(nd)::value, T, T>(logits, x, positions, slots, table, seq_lens,
                                                qstart, cos, sin, m, scale, rows);
  };
  switch (m.head_dim / kLanes) {
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 8: return run(std::integral_constant<int, 8>{});
    case 16: return run(std::integral_constant<int, 16>{});
    default: check(false, "decode_step: head_dim must be 32, 64, 96, 128 or 256");
  }
}

void decode_step(at::Tensor& logits, at::Tensor& x, const at::Tensor& positions,
                 const at::Tensor& slot_mapping, const at::Tensor& block_table,
                 const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& cos,
                 const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                 at::TensorList norms, at::TensorList linears,
                 const c10::List<c10::optional<at::Tensor>>& scales,
                 const c10::List<c10::optional<at::Tensor>>& biases, double eps, double scale,
                 int64_t num_heads, at::IntArrayRef windows, at::TensorList qk_norms,
                 int64_t rotary_dim, at::IntArrayRef rope_layers, at::IntArrayRef part_counts,
                 at::IntArrayRef qtypes, bool int8_x) {
  const int64_t rows = x.size(0), num_seqs = seq_lens.size(0);
  check(rows >= 1 && rows <= kMaxLinearRows, "decode_step takes 1 to 8 query tokens");
  check(x.is_contiguous() && logits.is_contiguous() && logits.size(0) == rows &&
            logits.scalar_type() == x.scalar_type(),
        "decode_step: x [rows, hidden] and logits [rows, vocab] contiguous, one dtype");
  check(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
            block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
            query_start.scalar_type() == at::kInt && block_table.is_contiguous() &&
            num_seqs >= 1 && num_seqs <= rows && query_start.size(0) == num_seqs + 1,
        "decode_step: int64 positions and slots, int32 block table, seq_lens, query_start");
  check(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
            sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes(),
        "decode_step: fp32 cos/sin tables");
  check(positions.is_contiguous() && slot_mapping.is_contiguous() && seq_lens.is_contiguous() &&
            query_start.is_contiguous() && positions.size(0) == rows &&
            slot_mapping.size(0) == rows && block_table.size(0) >= num_seqs,
        "decode_step: contiguous positions, slots (one per row), seq_lens, query_start");
  // each sequence has one query token (a decode) or a few (a decode verifying speculative
  // proposals, a short chunk): the last q_len tokens of its seq_len
  const int32_t* qs = query_start.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  check(qs[0] == 0 && qs[num_seqs] == rows, "decode_step: query_start must run from 0 to rows");
  for (int64_t s = 0; s < num_seqs; ++s)
    check(qs[s + 1] > qs[s] && lens[s] >= qs[s + 1] - qs[s],
          "decode_step: each sequence has query tokens, at most its length");
  const bool q8 = !k_caches.empty() && k_caches[0].scalar_type() == at::kByte;
  if (x.scalar_type() == at::kFloat) {
    auto m = step_model<float>(norms, linears, scales, biases, k_caches, v_caches, num_heads, eps,
                               windows, qk_norms, rotary_dim, rope_layers, part_counts, qtypes);
    m.int8_x = int8_x;
    check(logits.size(1) == m.vocab && x.size(1) == m.hidden && cos.size(1) == m.rotary_dim / 2,
          "decode_step: logits, x or rope table width");
    decode_step_typed<float>(logits, x, positions, slot_mapping, block_table, seq_lens,
                             query_start, cos, sin, m, scale, q8);
  } else if (x.scalar_type() == at::kBFloat16) {
    auto m = step_model<c10::BFloat16>(norms, linears, scales, biases, k_caches, v_caches,
                                       num_heads, eps, windows, qk_norms, rotary_dim,
                                       rope_layers, part_counts, qtypes);
    m.int8_x = int8_x;
    check(logits.size(1) == m.vocab && x.size(1) == m.hidden && cos.size(1) == m.rotary_dim / 2,
          "decode_step: logits, x or rope table width");
    decode_step_typed<c10::BFloat16>(logits, x, positions, slot_mapping, block_table, seq_lens,
                                     query_start, cos, sin, m, scale, q8);
  } else {
    check(false, "dtype must be float32 or bfloat16");
  }
}

// logits[r, t] = -inf for every token t whose bit is clear in bitmask[r] (bit t % 32 of
// word t / 32), for each row r listed in `rows`. A word of all ones (32 allowed tokens)
// is skipped whole and one of none is a plain fill: the masks of JSON-like constraints
// are mostly such words.
template <typename T>
void apply_token_bitmask_typed(T* lp, int64_t vocab, const uint32_t* bp, int64_t words,
                               const int64_t* rp, int64_t n) {
  const T neg = T(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* row = lp + rp[i] * vocab;
      const uint32_t* bits = bp + rp[i] * words;
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        const uint32_t u = bits[w];
        if (u == 0xFFFFFFFFu) continue;
        const int64_t end = std::min<int64_t>(32, vocab - w * 32);
        T* x = row + w * 32;
        if (u == 0) {  // none allowed: a straight fill the compiler vectorizes
          for (int64_t t = 0; t < end; ++t) x[t] = neg;
          continue;
        }
        for (uint32_t z = ~u & (end == 32 ? 0xFFFFFFFFu : (1u << end) - 1); z; z &= z - 1)
          x[__builtin_ctz(z)] = neg;  // each clear bit, lowest first
      }
    }
  });
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check(logits.dim() == 2 && logits.is_contiguous() &&
            (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
        "apply_token_bitmask: logits must be contiguous fp32 or bf16 [rows, vocab]");
  check(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
            bitmask.size(0) >= logits.size(0),
        "apply_token_bitmask: bitmask must be contiguous int32 [rows, words]");
  check(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
        "apply_token_bitmask: rows must be int64 [n]");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = rows.size(0);
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    check(rp[i] >= 0 && rp[i] < logits.size(0), "apply_token_bitmask: row out of range");
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.const_data_ptr<int32_t>());
  if (logits.scalar_type() == at::kFloat)
    apply_token_bitmask_typed(logits.data_ptr<float>(), vocab, bp, words, rp, n);
  else
    apply_token_bitmask_typed(logits.data_ptr<c10::BFloat16>(), vocab, bp, words, rp, n);
}

}  // namespace
}  // namespace tw

TORCH_LIBRARY(tidewire, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start, float scale, "
        "int num_decodes=-1, int window=0, Tensor? cascade_members=None, "
        "Tensor? cascade_offsets=None, Tensor? cascade_shared=None) -> ()",
        &tw::paged_attention);
  m.def("gguf_linear_small(Tensor(a!) out, Tensor x, Tensor w, int qtype, Tensor? bias, "
        "bool int8_x) -> ()",
        &tw::gguf_linear_small);
  m.def("gguf_dequant(Tensor(a!) out, Tensor w, int qtype) -> ()", &tw::gguf_dequant);
  m.def("gguf_packs(int qtype) -> bool", &tw::gguf_packs);
  m.def("gguf_x_group(int qtype) -> int", &tw::gguf_x_group);
  m.def("gguf_pack(Tensor(a!) out, Tensor w, int qtype) -> ()", &tw::gguf_pack);
  m.def("gguf_unpack(Tensor(a!) out, Tensor packed, int qtype) -> ()", &tw::gguf_unpack);
  m.def("gguf_packed_linear(Tensor(a!) out, Tensor x, Tensor packed, int qtype, Tensor? bias) -> ()",
        &tw::gguf_packed_linear);
  m.def("cpu_amx(int allow=-1) -> bool", &tw::cpu_amx);
  m.def("gguf_reads_int8(int qtype, int in_features) -> bool", &tw::gguf_reads_int8);
  m.def("gguf_gemm_int8(int qtype, int in_features) -> bool", &tw::gguf_gemm_int8);
  m.def("linear_int8_gemm(Tensor(a!) out, Tensor x, Tensor q, Tensor scale, Tensor? bias) -> ()",
        &tw::linear_int8_gemm);
  m.def("gguf_linear_tiled(Tensor(a!) out, Tensor x, Tensor w, int qtype, Tensor? bias, bool int8_x) -> ()",
        &tw::gguf_linear_tiled);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps, "
        "bool add) -> ()", &tw::rms_norm);
  m.def("rope_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads) -> ()",
        &tw::rope_cache);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &tw::silu_and_mul);
  m.def("decode_step(Tensor(a!) logits, Tensor(b!) x, Tensor positions, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start, Tensor cos, Tensor sin, "
        "Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor[] norms, Tensor[] linears, "
        "Tensor?[] scales, Tensor?[] biases, float eps, float scale, int num_heads, "
        "int[] windows, Tensor[] qk_norms, int rotary_dim=0, int[] rope_layers=[], "
        "int[] part_counts=[], int[] qtypes=[], bool int8_x=False) -> ()",
        &tw::decode_step);
  m.def("linear_small(Tensor(a!) out, Tensor x, Tensor w, Tensor? scale, Tensor? bias) -> ()",
        &tw::linear_small);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()",
        &tw::apply_token_bitmask);
}
