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
#include <cmath>
#include <cstring>
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
    // the keys this call reads of the sequence: [from, end) (AttnShape::key_start, limit)
    const int64_t from = sh.key_start ? sh.key_start[s] : 0;
    const int64_t end = sh.key_limit ? std::min<int64_t>(ctx, sh.key_limit[s]) : ctx;
    // keys of a one-tile sequence (the only kind split): [lo, end)
    const int64_t lo = std::max(from, first_key(ctx - q_len, sh)), keys = end - lo;
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
        const int64_t kb = parts > 1 ? lo : std::max(from, first_key(ctx - q_len + t, sh));
        for (int64_t p = 0; p < parts; ++p)
          items.push_back({int32_t(s), int32_t(h), int32_t(t), int32_t(std::min(q_len, t + tok_tile)),
                           int32_t(kb + p * span), int32_t(std::min(end, kb + (p + 1) * span)),
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

// Row r's log-sum-exp of its scores, where the call asks for them (AttnShape::lse).
inline void store_lse(const AttnShape& sh, const int32_t* qstart, const AttnItem& it, int64_t r,
                      float lse) {
  const int64_t tok = qstart[it.seq] + it.tok_begin + r / sh.group;
  sh.lse[tok * sh.num_heads + it.kv_head * sh.group + r % sh.group] = lse;
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
      if (sh.lse) store_lse(sh, qstart, it, r, w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : kNegInf);
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
    if (sh.lse) store_lse(sh, qstart, it, r, total > 0 ? m + std::log(total) : kNegInf);
  }
}

// The most rows an item of the matrix unit's takes: kMaxRowsAmx, fewer where the step
// would then have under 4 items a thread (counting the parts a long context of one query
// tile is split into: those read separate keys, where smaller tiles read the same keys
// again).
inline int64_t rows_for(const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
                        const AttnShape& sh, int threads) {
  int64_t rows = kMaxRowsAmx;
  for (; rows > kMaxRows; rows /= 2) {
    const int64_t tok_tile = std::max<int64_t>(1, rows / sh.group);
    int64_t items = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t q_len = qstart[s + 1] - qstart[s];
      const int64_t end = sh.key_limit ? std::min(seq_lens[s], sh.key_limit[s]) : seq_lens[s];
      const int64_t keys = end - (sh.key_start ? sh.key_start[s] : 0);
      const int64_t tiles = (q_len + tok_tile - 1) / tok_tile;
      items += sh.num_kv_heads *
               (tiles == 1 && keys >= 2 * kPartTokens ? (keys + kPartTokens - 1) / kPartTokens
                                                      : tiles);
    }
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
                amx ? rows_for(seq_lens, qstart, num_seqs, sh, threads) : kMaxRows);
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

// Shared-prefix (cascade) attention: sequences whose block tables begin with the same
// blocks read those keys once a step as a group. cascade.members[offsets[g],
// offsets[g + 1]) are group g's sequences (each in one group at most), whose first
// shared[g] keys are the same blocks and lie before every one of their queries. Their
// own keys, [shared, ctx), go through the batch as usual, with each row's log-sum-exp;
// each group's queries, gathered, attend to its shared keys as the rows of one sequence
// (many rows: the matrix unit's shape); the two results of a row are merged by their
// log-sum-exps. Sequences in no group run as paged_attention_impl runs them.
struct Cascade {
  const int32_t* members;
  const int32_t* offsets;  // [groups + 1]
  const int32_t* shared;   // [groups]
  int64_t groups;
};

template <int ND, typename T, typename C>
void cascade_attention_impl(T* out, const T* q, const C* kc, const C* vc, const int32_t* table,
                            const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
                            const AttnShape& sh, const Cascade& cas) {
  constexpr int D = ND * kLanes;
  const int64_t H = sh.num_heads, tokens = qstart[num_seqs];
  std::vector<int32_t> start(num_seqs, 0);
  int64_t gathered = 0;
  for (int64_t g = 0; g < cas.groups; ++g)
    for (int32_t i = cas.offsets[g]; i < cas.offsets[g + 1]; ++i) {
      const int32_t s = cas.members[i];
      start[s] = cas.shared[g];
      gathered += qstart[s + 1] - qstart[s];
    }
  // every sequence, the groups' members from their shared keys on
  std::vector<float> lse(tokens * H);
  AttnShape own = sh;
  own.key_start = start.data();
  own.lse = lse.data();
  paged_attention_impl<ND>(out, q, kc, vc, table, seq_lens, qstart, num_seqs, own);
  // the groups' queries against their shared keys: one sequence a group whose queries sit
  // past its keys (context shared + queries, keys limited to the shared ones)
  std::vector<T> qv(gathered * H * D), ov(gathered * H * D);
  std::vector<float> lse_v(gathered * H);
  std::vector<int32_t> v_lens(cas.groups), v_limit(cas.groups), v_qs(cas.groups + 1, 0);
  std::vector<int32_t> v_table(cas.groups * sh.max_blocks);
  std::vector<int64_t> source(gathered);  // the batch token of each gathered row
  int64_t row = 0;
  for (int64_t g = 0; g < cas.groups; ++g) {
    for (int32_t i = cas.offsets[g]; i < cas.offsets[g + 1]; ++i)
      for (int32_t t = qstart[cas.members[i]]; t < qstart[cas.members[i] + 1]; ++t) {
        std::memcpy(qv.data() + row * H * D, q + t * sh.q_stride, H * D * sizeof(T));
        source[row++] = t;
      }
    v_qs[g + 1] = static_cast<int32_t>(row);
    v_limit[g] = cas.shared[g];
    v_lens[g] = cas.shared[g] + (v_qs[g + 1] - v_qs[g]);
    std::memcpy(v_table.data() + g * sh.max_blocks,
                table + int64_t(cas.members[cas.offsets[g]]) * sh.max_blocks,
                sh.max_blocks * sizeof(int32_t));
  }
  AttnShape grp = sh;
  grp.q_stride = grp.out_stride = H * D;
  grp.key_limit = v_limit.data();
  grp.lse = lse_v.data();
  grp.num_decodes = 0;  // (a group's queries are never one decode's)
  paged_attention_impl<ND>(ov.data(), qv.data(), kc, vc, v_table.data(), v_lens.data(),
                           v_qs.data(), cas.groups, grp);
  at::parallel_for(0, gathered, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < H; ++h) {
        T* dst = out + source[r] * sh.out_stride + h * D;
        const T* other = ov.data() + (r * H + h) * D;
        const float a = lse[source[r] * H + h], b = lse_v[r * H + h];
        const float m = std::max(a, b);
        if (m == kNegInf) continue;  // (no key at all: cannot happen, keys include its own)
        const float wa = std::exp(a - m), wb = std::exp(b - m), inv = 1.0f / (wa + wb);
        for (int j = 0; j < ND; ++j)
          store16(dst + j * kLanes,
                  (load16(dst + j * kLanes) * wa + load16(other + j * kLanes) * wb) * inv);
      }
  });
}

}  // namespace tw
