// Paged attention on the CPU, reading K/V where they lie in the paged cache.
//
// Layouts (last dimension contiguous):
//   q           [num_tokens, num_heads, head_dim]     the step's queries, sequences back to
//                                                      back (query_start); rows may be strided
//   k_cache     [num_kv_heads, num_blocks, block_size, head_dim]   (v_cache alike), or a
//               q8 cache uint8 [num_kv_heads, num_blocks, block_size * (head_dim + 4)]
//   block_table [num_seqs, max_blocks] int32          logical block -> physical block
//   seq_lens    [num_seqs] int32                      context after this step (cached + new)
//   query_start [num_seqs + 1] int32                  cumulative query counts
//   out         [num_tokens, num_heads, head_dim]     rows may be strided
//
// Query i of sequence s sits at position seq_len - q_len + i and sees keys at positions
// <= its own, and with a sliding window W > 0 (AttnShape::window) only those above its
// position - W: each item's keys then begin where its first query's window does (on a
// 16-key boundary where decode kernels may take it; attend_item masks each row's keys
// below its own window), so keys no query of the item can see are never read.
//
// One work item = (sequence, KV head, tile of query tokens, context part): the queries
// of every head of the KV head's group are stacked as rows, so each K/V row is read once
// per group (GQA). Keys go by tiles of kKeyTile tokens, converted to fp32 in a small
// per-thread buffer (never a copy of the whole context); the softmax is online in fp32.
// A batch too small to keep every thread busy splits long contexts into parts whose
// partial results are merged exactly by their log-sum-exp.
//
// The tile loop (attend_item) is written once over two parameters: a row loader per
// cache format (attention_rows.h: bf16/fp32 rows in place, q8 rows dequantized) and a set
// of ISA primitives for scores and P V (attention_isa.h), chosen per build by AttnIsa.
// Decode items the build has a whole kernel for skip the loop (attention_decode.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "attention_base.h"
#include "attention_isa.h"
#include "attention_rows.h"

namespace tw {

// One work item: rows = (token, group head) pairs, keys [key_begin, key_end) of the
// sequence's context, causal (and within each row's sliding window). Leaves o
// (unnormalized) and m, l (running max, denominator).
// C: the cache's element type (uint8_t for a q8 cache).
template <int ND, typename T, typename C>
void attend_item(const AttnItem& it, const T* q, const C* kc, const C* vc, const int32_t* table,
                 int64_t ctx, int64_t q_len, int64_t q_row0, const AttnShape& sh,
                 AttnScratch& w, KeySpan after) {
  using Isa = AttnIsa<ND, T>;
  using Rows = RowLoader<C, typename Isa::Row>;
  constexpr int D = ND * kLanes;
  const int64_t G = sh.group, ntok = it.tok_end - it.tok_begin;
  const int rows = static_cast<int>(ntok * G);
  const int64_t pos0 = ctx - q_len + it.tok_begin;  // position of the first token
  const int64_t last = std::min<int64_t>(it.key_end, pos0 + ntok);  // keys after: unseen
  const int64_t q_row = q_row0 + it.tok_begin;
  const int64_t first = sh.window > 0 ? pos0 - sh.window + 1 : 0;  // a decode's first key
  if (Rows::template decode<ND>(it, q, kc, vc, table, first, last, q_len, q_row, sh, w, after))
    return;
  Rows loader(kc, vc, sh, table, it, last, after, w);
  Isa::template stage_queries<ND>(q + q_row * sh.q_stride + it.kv_head * G * D, ntok, G,
                                  sh.q_stride, sh.scale, w);
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  float corr[kMaxRowsAmx];
  for (int64_t kb = it.key_begin; kb < last; kb += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last - kb));
    const auto tile = loader.template tile<ND>(kb, nk);
    if (Isa::template whole_tile<ND>(w, sh.scale, rows, G, pos0 - kb, nk, sh.window, tile))
      continue;
    Isa::template scores<ND>(w, sh.scale, rows, tile, nk);
    if constexpr (!Rows::kValuesStaged) Isa::template stage_values<ND>(tile.v, nk, w);
    softmax_rows(w.s.data(), rows, G, pos0 - kb, nk, sh.window, w, corr);
    Isa::template accumulate<ND>(w, rows, corr, nk);
  }
}

// The first key a query tile whose first token sits at `pos` reads: 0 without a sliding
// window, else its first token's window start, rounded down to 16 keys where the block
// size allows (the decode kernels read 16-key chunks that lie in one block), so never in
// a block the window leaves out.
inline int64_t first_key(int64_t pos, const AttnShape& sh) {
  if (sh.window <= 0) return 0;
  const int64_t lo = std::max<int64_t>(0, pos - sh.window + 1);
  return sh.block_size % kLanes == 0 ? lo / kLanes * kLanes : lo;
}

// The items reordered longest first (rows x keys read), the parts of a split context kept
// together in their order: the threads take items in turn, so the last ones taken decide
// how long the others wait at the end, and a causal prefill's items grow with their
// position (its last query tile reads every key).
inline std::vector<AttnItem> longest_first(std::vector<AttnItem> items, const int32_t* seq_lens,
                                           const int32_t* qstart, const AttnShape& sh) {
  std::vector<std::pair<size_t, size_t>> units;  // [begin, end) of items run as one
  std::vector<int64_t> cost;
  for (size_t i = 0; i < items.size(); ++i) {
    const AttnItem& it = items[i];
    const int64_t ctx = seq_lens[it.seq], q_len = qstart[it.seq + 1] - qstart[it.seq];
    const int64_t last = std::min<int64_t>(it.key_end, ctx - q_len + it.tok_end);
    const int64_t c = (it.tok_end - it.tok_begin) * sh.group * std::max<int64_t>(1, last - it.key_begin);
    if (it.part > 0) {
      units.back().second = i + 1;
      cost.back() += c;
    } else {
      units.emplace_back(i, i + 1);
      cost.push_back(c);
    }
  }
  std::vector<size_t> order(units.size());
  for (size_t u = 0; u < order.size(); ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<AttnItem> out;
  out.reserve(items.size());
  for (size_t u : order)
    for (size_t i = units[u].first; i < units[u].second; ++i) out.push_back(items[i]);
  return out;
}

// Splits the step into work items (see the file comment).
inline std::vector<AttnItem> plan_items(const int32_t* seq_lens, const int32_t* qstart,
                                        int64_t num_seqs, const AttnShape& sh, int threads,
                                        int64_t max_rows) {
  const int64_t tok_tile = std::max<int64_t>(1, max_rows / sh.group);
  int64_t base = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    base += sh.num_kv_heads * ((qstart[s + 1] - qstart[s] + tok_tile - 1) / tok_tile);
  std::vector<AttnItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qstart[s + 1] - qstart[s], ctx = seq_lens[s];
    // keys of a one-tile sequence (the only kind split): [lo, ctx)
    const int64_t lo = first_key(ctx - q_len, sh), keys = ctx - lo;
    int64_t parts = 1;
    if (q_len > 0 && q_len <= tok_tile && base < 4 * threads && keys >= 2 * kPartTokens)
      parts = std::min<int64_t>((keys + kPartTokens - 1) / kPartTokens,
                                (4 * threads + base - 1) / base);
    int64_t span = keys;
    if (parts > 1) {  // parts are whole tiles from lo (so start on 16-key boundaries too)
      span = ((keys + parts - 1) / parts + kKeyTile - 1) / kKeyTile * kKeyTile;
      parts = (keys + span - 1) / span;
    }
    for (int64_t h = 0; h < sh.num_kv_heads; ++h)
      for (int64_t t = 0; t < q_len; t += tok_tile) {
        const int64_t kb = parts > 1 ? lo : first_key(ctx - q_len + t, sh);
        for (int64_t p = 0; p < parts; ++p)
          items.push_back({int32_t(s), int32_t(h), int32_t(t), int32_t(std::min(q_len, t + tok_tile)),
                           int32_t(kb + p * span), int32_t(std::min(ctx, kb + (p + 1) * span)),
                           int32_t(parts == 1 ? -1 : p)});
      }
  }
  return longest_first(std::move(items), seq_lens, qstart, sh);
}

// A step's work items and where the parts of split contexts keep their partial results.
struct AttnPlan {
  std::vector<AttnItem> items;
  std::vector<int64_t> part_base;                  // per item: first row in part_o, or -1
  std::vector<std::pair<size_t, size_t>> groups;   // item ranges merged into one output
  int64_t part_rows = 0;
  int64_t max_rows;                                // an item's most query rows
  std::vector<float> part_o, part_lse;

  AttnPlan(const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
           const AttnShape& sh, int threads, int64_t rows = kMaxRows)
      : items(plan_items(seq_lens, qstart, num_seqs, sh, threads, rows)),
        part_base(items.size(), -1), max_rows(rows) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].part < 0) continue;
      part_base[i] = part_rows;
      part_rows += (items[i].tok_end - items[i].tok_begin) * sh.group;
      if (items[i].part == 0) groups.emplace_back(i, i);
      groups.back().second = i + 1;  // parts of one (seq, kv head, tile) are consecutive
    }
    part_o.resize(part_rows * sh.head_dim);
    part_lse.resize(part_rows);
  }
};

template <typename T, int ND>
inline void store_row(T* out, const AttnShape& sh, const int32_t* qstart, const AttnItem& it,
                      int64_t r, const float* o, float inv) {
  const int64_t tok = qstart[it.seq] + it.tok_begin + r / sh.group;
  T* dst = out + tok * sh.out_stride + (it.kv_head * sh.group + r % sh.group) * ND * kLanes;
  for (int j = 0; j < ND; ++j) store16(dst + j * kLanes, load16(o + j * kLanes) * inv);
}

// Item i of the plan: its rows into `out`, or, for a part of a split context, into the
// plan's partial buffers.
template <int ND, typename T, typename C>
void run_item(AttnPlan& plan, size_t i, T* out, const T* q, const C* kc, const C* vc,
              const int32_t* table, const int32_t* seq_lens, const int32_t* qstart,
              const AttnShape& sh, AttnScratch& w, const KeySpan& after) {
  constexpr int D = ND * kLanes;
  const AttnItem& it = plan.items[i];
  const int64_t ctx = seq_lens[it.seq], q_len = qstart[it.seq + 1] - qstart[it.seq];
  attend_item<ND>(it, q, kc, vc, table + it.seq * sh.max_blocks, ctx, q_len, qstart[it.seq], sh,
                  w, after);
  const int64_t rows = (it.tok_end - it.tok_begin) * sh.group;
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = w.l[r] > 0 ? 1.0f / w.l[r] : 0.0f;
    const float* o = w.o.data() + r * D;
    if (it.part < 0) {
      store_row<T, ND>(out, sh, qstart, it, r, o, inv);
      continue;
    }
    float* dst = plan.part_o.data() + (plan.part_base[i] + r) * D;
    for (int j = 0; j < ND; ++j) store16(dst + j * kLanes, load16(o + j * kLanes) * inv);
    plan.part_lse[plan.part_base[i] + r] = w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : kNegInf;
  }
}

// The keys item i reads (none past the plan's end).
inline KeySpan item_keys(const AttnPlan& plan, size_t i, const int32_t* table,
                         const int32_t* seq_lens, const int32_t* qstart, const AttnShape& sh) {
  if (i >= plan.items.size()) return {};
  const AttnItem& it = plan.items[i];
  const int64_t ctx = seq_lens[it.seq], q_len = qstart[it.seq + 1] - qstart[it.seq];
  const int64_t last = std::min<int64_t>(it.key_end, ctx - q_len + it.tok_end);
  return {table + it.seq * sh.max_blocks, it.kv_head, it.key_begin, last};
}

// Items of the plan taken in turn from `next` by the calling thread. The thread claims
// its next item before it starts the current one, so the keys of both form one stream
// that its prefetches run ahead on; only the first tile of its first item is fetched
// in one go.
template <int ND, typename T, typename C>
void run_items(AttnPlan& plan, std::atomic<size_t>& next, T* out, const T* q, const C* kc,
               const C* vc, const int32_t* table, const int32_t* seq_lens,
               const int32_t* qstart, const AttnShape& sh, AttnScratch& w) {
  size_t cur = next++;
  if (cur < plan.items.size()) {
    const KeySpan first = item_keys(plan, cur, table, seq_lens, qstart, sh);
    const int64_t end = std::min<int64_t>(first.end, first.begin + kAheadKeys);
    prefetch_rows(kc, sh, first.table, first.kv_head, first.begin, end);
    prefetch_rows(vc, sh, first.table, first.kv_head, first.begin, end);
  }
  while (cur < plan.items.size()) {
    const size_t upcoming = next++;
    run_item<ND>(plan, cur, out, q, kc, vc, table, seq_lens, qstart, sh, w,
                 item_keys(plan, upcoming, table, seq_lens, qstart, sh));
    cur = upcoming;
  }
}

// Group g of split parts: their outputs merged exactly by log-sum-exp into `out`.
template <int ND, typename T>
void merge_group(const AttnPlan& plan, size_t g, T* out, const int32_t* qstart,
                 const AttnShape& sh) {
  constexpr int D = ND * kLanes;
  const auto [b, e] = plan.groups[g];
  const AttnItem& it = plan.items[b];
  const int64_t rows = (it.tok_end - it.tok_begin) * sh.group;
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (size_t p = b; p < e; ++p) m = std::max(m, plan.part_lse[plan.part_base[p] + r]);
    f32x16 acc[ND] = {};
    float total = 0.0f;
    for (size_t p = b; p < e; ++p) {
      const float lse = plan.part_lse[plan.part_base[p] + r];
      if (lse == kNegInf) continue;
      const float wgt = std::exp(lse - m);
      total += wgt;
      const float* o = plan.part_o.data() + (plan.part_base[p] + r) * D;
      for (int j = 0; j < ND; ++j) acc[j] += wgt * load16(o + j * kLanes);
    }
    float merged[D];
    for (int j = 0; j < ND; ++j) store16(merged + j * kLanes, acc[j]);
    store_row<T, ND>(out, sh, qstart, it, r, merged, total > 0 ? 1.0f / total : 0.0f);
  }
}

// The most rows an item of the matrix unit's takes: kMaxRowsAmx, fewer where the step
// would then have under 4 items a thread.
inline int64_t rows_for(const int32_t* qstart, int64_t num_seqs, const AttnShape& sh,
                        int threads) {
  int64_t rows = kMaxRowsAmx;
  for (; rows > kMaxRows; rows /= 2) {
    const int64_t tok_tile = std::max<int64_t>(1, rows / sh.group);
    int64_t items = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
      items += sh.num_kv_heads * ((qstart[s + 1] - qstart[s] + tok_tile - 1) / tok_tile);
    if (items >= 4 * threads) break;
  }
  return rows;
}

template <int ND, typename T, typename C>
void paged_attention_impl(T* out, const T* q, const C* kc, const C* vc, const int32_t* table,
                          const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
                          const AttnShape& sh) {
  const int threads = at::get_num_threads();
  bool amx = false;
#if defined(TW_ATTN_AMX)
  // the matrix unit for items of many rows (a sequence of 8 query rows or more), where
  // the primitives are the bf16 ones; such items then take up to kMaxRowsAmx rows
  if constexpr (std::is_same_v<AttnIsa<ND, T>, AttnBf16Dot>) {
    int64_t most = 0;
    for (int64_t s = 0; s < num_seqs; ++s) most = std::max<int64_t>(most, qstart[s + 1] - qstart[s]);
    amx = most * sh.group >= 8 && amx_on();
  }
#endif
  AttnPlan plan(seq_lens, qstart, num_seqs, sh, threads,
                amx ? rows_for(qstart, num_seqs, sh, threads) : kMaxRows);
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local AttnScratch w;
    w.reserve(sh.head_dim, plan.max_rows);
#if defined(TW_ATTN_AMX)
    const AmxRegion tiles(amx);
    w.amx = amx;
#endif
    run_items<ND>(plan, next, out, q, kc, vc, table, seq_lens, qstart, sh, w);
#if defined(TW_ATTN_AMX)
    w.amx = false;
#endif
  });
  for (size_t g = 0; g < plan.groups.size(); ++g) merge_group<ND>(plan, g, out, qstart, sh);
}

}  // namespace tw
