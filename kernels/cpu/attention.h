// Paged attention on the CPU, reading K/V where they lie in the paged cache.
//
// Layouts (last dimension contiguous):
//   q           [num_tokens, num_heads, head_dim]     the step's queries, sequences back to
//                                                      back (query_start); rows may be strided
//   k_cache     [num_kv_heads, num_blocks, block_size, head_dim]   (v_cache alike)
//   block_table [num_seqs, max_blocks] int32          logical block -> physical block
//   seq_lens    [num_seqs] int32                      context after this step (cached + new)
//   query_start [num_seqs + 1] int32                  cumulative query counts
//   out         [num_tokens, num_heads, head_dim]     rows may be strided
//
// Query i of sequence s sits at position seq_len - q_len + i and sees keys at positions
// <= its own. One work item = (sequence, KV head, tile of query tokens, context part):
// the queries of every head of the KV head's group are stacked as rows, so each K/V row
// is read once per group (GQA). Keys go by tiles of kKeyTile tokens, converted to fp32
// in a small per-thread buffer (never a copy of the whole context); the softmax is
// online in fp32. A batch too small to keep every thread busy splits long contexts into
// parts whose partial results are merged exactly by their log-sum-exp.
#pragma once

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "linear.h"  // has_bf16_dot
#include "vec.h"

namespace tw {

constexpr int kKeyTile = 64;        // keys per tile
constexpr int kTileVecs = kKeyTile / kLanes;
constexpr int kMaxRows = 64;        // query rows (tokens x group heads) per work item
constexpr int kPartTokens = 512;    // context tokens per part when a context is split
constexpr int kAheadKeys = 128;     // how far ahead of the keys in use the prefetches run
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttnItem {
  int32_t seq, kv_head, tok_begin, tok_end, key_begin, key_end, part;
};

struct AttnShape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks, max_blocks;
  int64_t q_stride, out_stride;  // elements between consecutive tokens
  float scale;
  // sequences [0, num_decodes) are decode steps (a q8 cache sends their queries through
  // int8; attention_q8.h); the rest are prefill chunks, whatever their length
  int64_t num_decodes = std::numeric_limits<int64_t>::max();
};

// Per-thread scratch of one work item.
struct AttnScratch {
  std::vector<float> q, o, s, kt, v, m, l;
  std::vector<float> kq;          // a q8 cache's key tile as fp32 rows (kKeyTile x d)
  std::vector<c10::BFloat16> qb;  // bf16 queries, unscaled (the bf16 dot-product path)
  void reserve(int64_t d) {
    q.resize(kMaxRows * d);
    qb.resize(kMaxRows * d);
    o.resize(kMaxRows * d);
    s.resize(kMaxRows * kKeyTile);
    kt.resize(d * kKeyTile);
    kq.resize(kKeyTile * d);
    v.resize(kKeyTile * d);
    m.resize(kMaxRows);
    l.resize(kMaxRows);
  }
};

// Row pointers of keys [kb, kb + nk) of one KV head: the block table is read once per
// block, not divided out per key.
template <typename T>
inline void kv_rows(const T* cache, const AttnShape& sh, const int32_t* table, int64_t kvh,
                    int64_t kb, int nk, const T** rows) {
  const int64_t bs = sh.block_size, d = sh.head_dim;
  const T* head = cache + kvh * sh.num_blocks * bs * d;
  int64_t blk = kb / bs, off = kb % bs;
  const T* base = head + int64_t(table[blk]) * bs * d;
  for (int k = 0; k < nk; ++k) {
    rows[k] = base + off * d;
    if (++off == bs && k + 1 < nk) {
      off = 0;
      base = head + int64_t(table[++blk]) * bs * d;
    }
  }
}

// Asks for keys [kb, kb + nk) of one KV head ahead of their use: the cache is scattered
// over blocks, so without this every block costs a trip to DRAM that the hardware
// prefetcher never sees coming.
template <typename T>
inline void prefetch_rows(const T* cache, const AttnShape& sh, const int32_t* table, int64_t kvh,
                          int64_t kb, int64_t ke) {
  const int64_t bs = sh.block_size, d = sh.head_dim;
  const char* head = reinterpret_cast<const char*>(cache + kvh * sh.num_blocks * bs * d);
  for (int64_t pos = kb; pos < ke;) {
    const int64_t off = pos % bs, n = std::min(bs - off, ke - pos);
    const char* p = head + ((int64_t(table[pos / bs]) * bs + off) * d) * int64_t(sizeof(T));
    for (int64_t b = 0; b < n * d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
    pos += n;
  }
}

// Keys [begin, end) of one KV head of one sequence: a stretch of the stream of keys a
// thread reads, item after item.
struct KeySpan {
  const int32_t* table = nullptr;  // the sequence's row of the block table
  int64_t kv_head = 0, begin = 0, end = 0;
};

// Row pointers of the next n keys of the stream that continues at span a and then span b
// (a advances); fewer where both run out. What a tile prefetches, a key at a time, for
// the tile after it.
template <typename T>
inline int take_keys(const T* kc, const T* vc, const AttnShape& sh, KeySpan& a, KeySpan& b,
                     int n, const T** ks, const T** vs) {
  int got = 0;
  for (KeySpan* sp : {&a, &b}) {
    const int m = static_cast<int>(std::min<int64_t>(n - got, sp->end - sp->begin));
    if (m <= 0) continue;
    kv_rows(kc, sh, sp->table, sp->kv_head, sp->begin, m, ks + got);
    kv_rows(vc, sh, sp->table, sp->kv_head, sp->begin, m, vs + got);
    sp->begin += m;
    got += m;
  }
  return got;
}

// Asks for one key's K and V rows. Spread over a tile's work (a key or a few between
// arithmetic) rather than as one burst: a burst of hundreds of prefetches fills the
// core's miss buffers and stalls it until they drain, so memory and arithmetic take
// turns instead of overlapping (measured: a burst per tile ran no faster than none).
template <typename T>
inline void prefetch_key(const T* k, const T* v, int64_t row_bytes) {
  const char* kp = reinterpret_cast<const char*>(k);
  const char* vp = reinterpret_cast<const char*>(v);
  for (int64_t b = 0; b < row_bytes; b += 64) {
    __builtin_prefetch(kp + b, 0, 3);
    __builtin_prefetch(vp + b, 0, 3);
  }
}

// Scores of `rows` query rows against `nk` keys, a dot product per (row, key): for a few
// rows (decodes) that costs less than transposing the key tile. The tile is converted
// to fp32 once (kf [kKeyTile][D]); each row's dot products go 16 keys at a time into
// one vector of scores (hsum16).
template <int ND, typename T>
inline void scores_by_dot(const float* q, int rows, const T* const* krows, int nk, float* kf,
                          float* s) {
  constexpr int D = ND * kLanes;
  for (int k = 0; k < nk; ++k)
    for (int j = 0; j < ND; ++j) store16(kf + k * D + j * kLanes, load16(krows[k] + j * kLanes));
  // Keys past nk score whatever the buffer holds (finite): the softmax masks them.
  for (int k0 = 0; k0 < nk; k0 += kLanes) {
    for (int r = 0; r < rows; ++r) {
      f32x16 qv[ND];
      for (int j = 0; j < ND; ++j) qv[j] = load16(q + r * D + j * kLanes);
      f32x16 acc[kLanes];
      for (int k = 0; k < kLanes; ++k) {
        const float* kr = kf + (k0 + k) * D;
        acc[k] = qv[0] * load16(kr);
        for (int j = 1; j < ND; ++j) acc[k] += qv[j] * load16(kr + j * kLanes);
      }
      store16(s + r * kKeyTile + k0, hsum16(acc));
    }
  }
}

#if defined(__AVX512BF16__)
// scores_by_dot for bf16 caches on CPUs with AVX512-BF16: pairs of bf16 products summed
// in fp32 by vdpbf16ps straight from the cache (no conversion of K), then scaled.
template <int ND>
inline void scores_by_dot_bf16(const c10::BFloat16* qb, float scale, int rows,
                               const c10::BFloat16* const* krows, int nk, float* s,
                               const c10::BFloat16* const* ka, const c10::BFloat16* const* va,
                               int na) {
  constexpr int D = ND * kLanes, NV = D / 32;
  for (int k0 = 0; k0 < nk; k0 += kLanes) {
    const int n = std::min(kLanes, nk - k0);
    for (int k = k0; k < std::min(na, k0 + kLanes); ++k)
      prefetch_key(ka[k], va[k], D * 2);
    for (int r = 0; r < rows; ++r) {
      __m512bh qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qb + r * D + j * 32);
      f32x16 acc[kLanes];
      for (int k = 0; k < kLanes; ++k) {
        const c10::BFloat16* kr = krows[k0 + std::min(k, n - 1)];  // past nk: masked later
        __m512 a = _mm512_setzero_ps();
        for (int j = 0; j < NV; ++j)
          a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(kr + j * 32));
        acc[k] = (f32x16)a;
      }
      store16(s + r * kKeyTile + k0, hsum16(acc) * scale);
    }
  }
}

// scores_by_tile for bf16 caches with AVX512-BF16: the key tile transposed by bf16 pairs
// (kp[d / 2][kKeyTile] of 32-bit pairs), then each row's pair of query values broadcast
// against 16 keys' pairs per vdpbf16ps: half the instructions of the fp32 tile.
template <int ND>
inline void scores_by_tile_bf16(const c10::BFloat16* qb, float scale, int rows,
                                const c10::BFloat16* const* krows, int nk, float* buf, float* s) {
  constexpr int NP = ND * kLanes / 2;
  uint32_t* kp = reinterpret_cast<uint32_t*>(buf);
  for (int k = 0; k < nk; ++k) {
    uint32_t pairs[NP];
    std::memcpy(pairs, krows[k], sizeof(pairs));
    for (int i = 0; i < NP; ++i) kp[i * kKeyTile + k] = pairs[i];
  }
  for (int k = nk; k < kKeyTile; ++k)
    for (int i = 0; i < NP; ++i) kp[i * kKeyTile + k] = 0;
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(qb);
  auto block = [&](int r, auto rb) {
    constexpr int RB = decltype(rb)::value;
    __m512 a[RB][kTileVecs];
    for (int i = 0; i < RB; ++i)
      for (int c = 0; c < kTileVecs; ++c) a[i][c] = _mm512_setzero_ps();
    for (int i = 0; i < NP; ++i) {
      __m512bh kv[kTileVecs];
      for (int c = 0; c < kTileVecs; ++c)
        kv[c] = (__m512bh)_mm512_loadu_si512(kp + i * kKeyTile + c * kLanes);
      for (int j = 0; j < RB; ++j) {
        const __m512bh qq = (__m512bh)_mm512_set1_epi32(int(qp[(r + j) * NP + i]));
        for (int c = 0; c < kTileVecs; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], qq, kv[c]);
      }
    }
    for (int j = 0; j < RB; ++j)
      for (int c = 0; c < kTileVecs; ++c)
        store16(s + (r + j) * kKeyTile + c * kLanes, (f32x16)a[j][c] * scale);
  };
  int r = 0;
  for (; r + 4 <= rows; r += 4) block(r, std::integral_constant<int, 4>{});
  for (; r < rows; ++r) block(r, std::integral_constant<int, 1>{});
}
#endif

// Scores of many query rows (prefill): the key tile transposed once to kt[d][kKeyTile]
// in fp32, then four rows at a time against the tile's vectors of keys.
template <int ND, typename T>
inline void scores_by_tile(const float* q, int rows, const T* const* krows, int nk, float* kt,
                           float* s) {
  constexpr int D = ND * kLanes;
  for (int k = 0; k < nk; ++k) {
    for (int j = 0; j < ND; ++j) {
      f32x16 x = load16(krows[k] + j * kLanes);
      for (int i = 0; i < kLanes; ++i) kt[(j * kLanes + i) * kKeyTile + k] = x[i];
    }
  }
  for (int k = nk; k < kKeyTile; ++k)
    for (int d = 0; d < D; ++d) kt[d * kKeyTile + k] = 0.0f;
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    f32x16 a[4][kTileVecs] = {};
    for (int d = 0; d < D; ++d) {
      f32x16 kv[kTileVecs];
      for (int c = 0; c < kTileVecs; ++c) kv[c] = load16(kt + d * kKeyTile + c * kLanes);
      for (int i = 0; i < 4; ++i) {
        const float x = q[(r + i) * D + d];
        for (int c = 0; c < kTileVecs; ++c) a[i][c] += x * kv[c];
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < kTileVecs; ++c) store16(s + (r + i) * kKeyTile + c * kLanes, a[i][c]);
  }
  for (; r < rows; ++r) {
    f32x16 a[kTileVecs] = {};
    for (int d = 0; d < D; ++d) {
      const float x = q[r * D + d];
      for (int c = 0; c < kTileVecs; ++c) a[c] += x * load16(kt + d * kKeyTile + c * kLanes);
    }
    for (int c = 0; c < kTileVecs; ++c) store16(s + r * kKeyTile + c * kLanes, a[c]);
  }
}

// Online-softmax update of one row's scores s[0, seen) (the rest masked): leaves the
// probabilities in s and returns the factor by which the row's output must shrink.
inline float softmax_update(float* s, int seen, float& m, float& l) {
  for (int k = seen; k < kKeyTile; ++k) s[k] = kNegInf;
  f32x16 v[kTileVecs];
  f32x16 mx = splat(kNegInf);
  for (int c = 0; c < kTileVecs; ++c) mx = vmax(mx, v[c] = load16(s + c * kLanes));
  const float m_new = std::max(m, hmax(mx));
  const float corr = sexp(m - m_new);
  f32x16 sum = {};
  for (int c = 0; c < kTileVecs; ++c) {
    v[c] = vexp(v[c] - m_new);
    sum += v[c];
    store16(s + c * kLanes, v[c]);
  }
  l = l * corr + hsum(sum);
  m = m_new;
  return corr;
}

// o[r] = o[r] * corr[r] + sum_k p[r][k] v[k] for rows [r0, r0 + R), R <= 2: each V row
// is loaded once for both rows.
template <int ND, int R>
inline void accumulate_pv(float* o, const float* p, const float* corr, const float* v, int nk) {
  constexpr int D = ND * kLanes;
  f32x16 acc[R][ND];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < ND; ++j) acc[i][j] = load16(o + i * D + j * kLanes) * corr[i];
  for (int k = 0; k < nk; ++k) {
    for (int j = 0; j < ND; ++j) {
      const f32x16 x = load16(v + k * D + j * kLanes);
      for (int i = 0; i < R; ++i) acc[i][j] += p[i * kKeyTile + k] * x;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < ND; ++j) store16(o + i * D + j * kLanes, acc[i][j]);
}

#if defined(__AVX512BF16__)
// The V tile by pairs of keys, vp[k / 2][D] of 32-bit (bf16 V[k][d], V[k + 1][d]) pairs,
// a missing last key as zeros: what accumulate_pv_bf16 reads.
template <int ND>
inline void pair_values(const c10::BFloat16* const* vrows, int nk, uint32_t* vp) {
  constexpr int D = ND * kLanes;
  uint16_t zero[D] = {};
  for (int k = 0; k < nk; k += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(vrows[k]);
    const uint16_t* b = k + 1 < nk ? reinterpret_cast<const uint16_t*>(vrows[k + 1]) : zero;
    uint32_t* dst = vp + (k / 2) * D;
    for (int d = 0; d < D; ++d) dst[d] = uint32_t(a[d]) | (uint32_t(b[d]) << 16);
  }
}

// accumulate_pv with the probabilities rounded to bf16 (as flash attention does on GPUs)
// and pairs of keys summed by vdpbf16ps: half the instructions of the fp32 loop.
template <int ND, int R>
inline void accumulate_pv_bf16(float* o, const float* p, const float* corr, const uint32_t* vp,
                               int nk) {
  constexpr int D = ND * kLanes;
  alignas(64) uint32_t pb[R][kKeyTile / 2];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kTileVecs; c += 2) {
      const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + i * kKeyTile + (c + 1) * kLanes),
                                             _mm512_loadu_ps(p + i * kKeyTile + c * kLanes));
      _mm512_storeu_si512(pb[i] + c * kLanes / 2, (__m512i)x);
    }
  __m512 acc[R][ND];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < ND; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int k2 = 0; k2 < (nk + 1) / 2; ++k2) {
    __m512bh vv[ND];
    for (int j = 0; j < ND; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vp + k2 * D + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pb[i][k2]));
      for (int j = 0; j < ND; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pp, vv[j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < ND; ++j)
      store16(o + i * D + j * kLanes,
              load16(o + i * D + j * kLanes) * corr[i] + (f32x16)acc[i][j]);
}
#endif

// A stretch of the key stream read a 16-key chunk at a time (chunks never straddle a
// block: block sizes here are multiples of 16 and spans start on multiples of 16).
struct ChunkCursor {
  KeySpan a, b;  // the rest of this item, then the next item
  // The next chunk's span, first position and key count n (advancing); n = 0 when the
  // stream has run out.
  const KeySpan* take(int& n, int64_t& pos) {
    KeySpan& sp = a.begin < a.end ? a : b;
    n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kLanes, sp.end - sp.begin)));
    pos = sp.begin;
    sp.begin += n;
    return &sp;
  }
  // Offset of the next chunk's first row in the K (and V) cache, in elements.
  int64_t next(const AttnShape& sh, int& n) {
    int64_t pos;
    const KeySpan* sp = take(n, pos);
    if (n == 0) return 0;
    const int64_t bs = sh.block_size;
    return ((sp->kv_head * sh.num_blocks + sp->table[pos / bs]) * bs + pos % bs) * sh.head_dim;
  }
  // The same for a q8 cache: the chunk's block (byte offset) and its first row there.
  void next_q8(const AttnShape& sh, int& n, int64_t& block, int64_t& off) {
    int64_t pos;
    const KeySpan* sp = take(n, pos);
    if (n == 0) return;
    const int64_t bs = sh.block_size;
    block = (sp->kv_head * sh.num_blocks + sp->table[pos / bs]) * bs * (sh.head_dim + 4);
    off = pos % bs;
  }
};

#if defined(__AVX512BF16__)
// The decode work item for bf16 caches on CPUs with AVX512-BF16 and block sizes that are
// multiples of 16: one query token, its group's G <= 8 heads as rows. Keys go by 16-key
// chunks that lie in one block each, so K and V rows are addressed from one base per
// chunk (no per-key pointer tables). Scores: vdpbf16ps straight from the cache, 16 keys
// reduced at once (hsum16). P.V: each pair of V rows interleaved in registers (vpermt2w)
// and multiplied by the rows' probability pairs with vdpbf16ps, at most four rows per
// pass. Prefetches run kAheadKeys ahead in the thread's key stream, one key's lines per
// key scored.
template <int ND>
void attend_decode_bf16(const AttnItem& it, const c10::BFloat16* q, const c10::BFloat16* kc,
                        const c10::BFloat16* vc, const int32_t* table, int64_t last,
                        int64_t q_row, const AttnShape& sh, AttnScratch& w, KeySpan after) {
  using bf16 = c10::BFloat16;
  constexpr int D = ND * kLanes, NV = D / 32;
  const int G = static_cast<int>(sh.group);
  const int64_t bs = sh.block_size;
  const bf16* qrow = q + q_row * sh.q_stride + it.kv_head * G * D;
  __m512bh qv[8][NV];
  for (int r = 0; r < G; ++r)
    for (int j = 0; j < NV; ++j) qv[r][j] = (__m512bh)_mm512_loadu_si512(qrow + r * D + j * 32);
  float m[8], l[8];
  f32x16 o[8][ND];
  for (int r = 0; r < G; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
    for (int j = 0; j < ND; ++j) o[r][j] = splat(0.0f);
  }
  ChunkCursor ahead{{table, it.kv_head, std::min<int64_t>(last, it.key_begin + kAheadKeys), last},
                    after};
  // lane i of the low / high result: element i / 16 + i of a, then of b (pairs of keys)
  alignas(64) static const uint16_t kLoIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                  6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                  12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHiIdx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLoIdx), hi_idx = _mm512_load_si512(kHiIdx);
  alignas(64) float s[8][kKeyTile];
  int64_t chunk_off[kTileVecs];  // of the tile's chunks, in the K and V caches
  for (int64_t kb = it.key_begin; kb < last; kb += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last - kb));
    const int chunks = (nk + kLanes - 1) / kLanes;
    for (int c = 0; c < chunks; ++c) {
      const int64_t pos = kb + c * kLanes;
      chunk_off[c] = ((it.kv_head * sh.num_blocks + table[pos / bs]) * bs + pos % bs) * D;
      const bf16* kp = kc + chunk_off[c];
      const int n = std::min(kLanes, nk - c * kLanes);
      int an = 0;
      const int64_t ao = ahead.next(sh, an);
      const bf16* krow[kLanes];
      for (int k = 0; k < kLanes; ++k) krow[k] = kp + std::min(k, n - 1) * D;  // past n: masked
      for (int r = 0; r < G; ++r) {
        f32x16 acc[kLanes];
#pragma GCC unroll 16
        for (int k = 0; k < kLanes; ++k) {
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[r][0],
                                      (__m512bh)_mm512_loadu_si512(krow[k]));
          for (int j = 1; j < NV; ++j)
            a = _mm512_dpbf16_ps(a, qv[r][j], (__m512bh)_mm512_loadu_si512(krow[k] + j * 32));
          acc[k] = (f32x16)a;
        }
        store16(s[r] + c * kLanes, hsum16(acc) * sh.scale);
        // this row's share of the chunk kAheadKeys ahead, between rows' arithmetic
        for (int k = r * an / G; k < (r + 1) * an / G; ++k)
          prefetch_key(kc + ao + k * D, vc + ao + k * D, D * 2);
      }
    }
    float corr[8];
    for (int r = 0; r < G; ++r) corr[r] = softmax_update(s[r], nk, m[r], l[r]);
    // P.V, keys by pairs; rows four at a time (registers: 4 x ND accumulators)
    for (int r0 = 0; r0 < G; r0 += 4) {
      const int R = std::min(4, G - r0);
      alignas(64) uint32_t pb[4][kKeyTile / 2];
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < kTileVecs; c += 2) {
          const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_load_ps(s[r0 + i] + (c + 1) * kLanes),
                                                 _mm512_load_ps(s[r0 + i] + c * kLanes));
          _mm512_store_si512(pb[i] + c * kLanes / 2, (__m512i)x);
        }
      __m512 acc[4][ND];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < ND; ++j) acc[i][j] = _mm512_setzero_ps();
      for (int k = 0; k < nk; k += 2) {
        const bf16* va = vc + chunk_off[k / kLanes] + (k % kLanes) * D;
        const bf16* vb = k + 1 < nk ? va + D : nullptr;  // a missing last key: zeros
        for (int j = 0; j < NV; ++j) {
          const __m512i x = _mm512_loadu_si512(va + j * 32);
          const __m512i y = vb ? _mm512_loadu_si512(vb + j * 32) : _mm512_setzero_si512();
          const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(x, lo_idx, y);
          const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(x, hi_idx, y);
          for (int i = 0; i < R; ++i) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pb[i][k / 2]));
            acc[i][2 * j] = _mm512_dpbf16_ps(acc[i][2 * j], pp, lo);
            acc[i][2 * j + 1] = _mm512_dpbf16_ps(acc[i][2 * j + 1], pp, hi);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < ND; ++j)
          o[r0 + i][j] = o[r0 + i][j] * corr[r0 + i] + (f32x16)acc[i][j];
    }
  }
  for (int r = 0; r < G; ++r) {
    w.m[r] = m[r];
    w.l[r] = l[r];
    for (int j = 0; j < ND; ++j) store16(w.o.data() + r * D + j * kLanes, o[r][j]);
  }
}
#endif

// The online-softmax step of a tile for each of `rows` query rows (token r / G of the
// item, whose position is `rel` + r / G relative to the tile's first key): causal, and
// leaves the probabilities in s and each row's rescale factor in corr.
inline void softmax_rows(float* s, int rows, int64_t G, int64_t rel, int nk, AttnScratch& w,
                         float* corr) {
  for (int r = 0; r < rows; ++r) {
    const int64_t seen = std::min<int64_t>(nk, rel + r / G + 1);  // causal
    if (seen <= 0) {  // nothing visible in this tile: p = 0, the output stays
      std::fill(s + r * kKeyTile, s + (r + 1) * kKeyTile, 0.0f);
      corr[r] = 1.0f;
    } else {
      corr[r] = softmax_update(s + r * kKeyTile, static_cast<int>(seen), w.m[r], w.l[r]);
    }
  }
}

// o += P V for rows [r, rows) from the fp32 V tile in w.v, two rows per pass.
template <int ND>
inline void accumulate_rows(AttnScratch& w, int rows, int r, const float* corr, int nk) {
  constexpr int D = ND * kLanes;
  const float* s = w.s.data();
  for (; r + 2 <= rows; r += 2)
    accumulate_pv<ND, 2>(w.o.data() + r * D, s + r * kKeyTile, corr + r, w.v.data(), nk);
  if (r < rows)
    accumulate_pv<ND, 1>(w.o.data() + r * D, s + r * kKeyTile, corr + r, w.v.data(), nk);
}

#if defined(__AVX512BF16__)
// accumulate_rows for the bf16 path: the V tile as key pairs (pair_values) in w.v.
template <int ND>
inline void accumulate_rows_bf16(AttnScratch& w, int rows, const float* corr, int nk) {
  constexpr int D = ND * kLanes;
  const float* s = w.s.data();
  const uint32_t* vp = reinterpret_cast<const uint32_t*>(w.v.data());
  int r = 0;
  for (; r + 2 <= rows; r += 2)
    accumulate_pv_bf16<ND, 2>(w.o.data() + r * D, s + r * kKeyTile, corr + r, vp, nk);
  if (r < rows)
    accumulate_pv_bf16<ND, 1>(w.o.data() + r * D, s + r * kKeyTile, corr + r, vp, nk);
}
#endif

#if !defined(__AVX512F__)
// Without AVX-512: scores and P V with 8-lane vectors (vec.h), a few accumulators at a
// time, so that they stay in registers (the 16-lane versions above spilled: 5 query
// tokens of a 3-head group over 400 keys took ~1 ms a layer on an AVX2 EPYC).
template <int ND, typename T>
inline void scores_avx2(const float* q, int rows, const T* const* krows, int nk, float* kf,
                        float* s) {
  constexpr int D = ND * kLanes, NV = D / 8;
  for (int k = 0; k < nk; ++k)
    for (int j = 0; j < NV; ++j) store8(kf + k * D + j * 8, load8(krows[k] + j * 8));
  for (int r = 0; r < rows; ++r) {
    const float* qr = q + r * D;
    float* sr = s + r * kKeyTile;
    int k = 0;
    for (; k + 4 <= nk; k += 4) {  // four keys: four independent chains
      f32x8 a[4] = {};
      for (int j = 0; j < NV; ++j) {
        const f32x8 qv = load8(qr + j * 8);
        for (int u = 0; u < 4; ++u) a[u] += qv * load8(kf + (k + u) * D + j * 8);
      }
      for (int u = 0; u < 4; ++u) sr[k + u] = hsum8(a[u]);
    }
    for (; k < nk; ++k) {
      f32x8 a = {};
      for (int j = 0; j < NV; ++j) a += load8(qr + j * 8) * load8(kf + k * D + j * 8);
      sr[k] = hsum8(a);
    }
  }
}

// o = o * corr + sum_k p[k] v[k] for one row, from the fp32 V tile.
template <int ND>
inline void accumulate_avx2(float* o, const float* p, float corr, const float* v, int nk) {
  constexpr int D = ND * kLanes, NV = D / 8;
  f32x8 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = load8(o + j * 8) * corr;
  for (int k = 0; k < nk; ++k) {
    const float pk = p[k];
    for (int j = 0; j < NV; ++j) acc[j] += pk * load8(v + k * D + j * 8);
  }
  for (int j = 0; j < NV; ++j) store8(o + j * 8, acc[j]);
}
#endif

// One work item: rows = (token, group head) pairs, keys [key_begin, key_end) of the
// sequence's context, causal. Leaves o (unnormalized) and m, l (running max, denominator).
template <int ND, typename T>
void attend_item(const AttnItem& it, const T* q, const T* kc, const T* vc, const int32_t* table,
                 int64_t ctx, int64_t q_len, int64_t q_row0, const AttnShape& sh,
                 AttnScratch& w, KeySpan after) {
  constexpr int D = ND * kLanes;
  const int64_t G = sh.group, ntok = it.tok_end - it.tok_begin;
  const int rows = static_cast<int>(ntok * G);
  const int64_t pos0 = ctx - q_len + it.tok_begin;  // position of the first token
  const int64_t last = std::min<int64_t>(it.key_end, pos0 + ntok);  // keys after: unseen
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && ND % 2 == 0) {
    if (ntok == 1 && G <= 8 && sh.block_size % kLanes == 0 && it.key_begin % kLanes == 0) {
      attend_decode_bf16<ND>(it, q, kc, vc, table, last, q_row0 + it.tok_begin, sh, w, after);
      return;
    }
  }
#endif
  // The stream of keys one tile ahead: this item's after its first tile (that one was
  // asked for by whatever ran before), then the next item's (`after`).
  KeySpan ahead{table, it.kv_head, std::min<int64_t>(last, it.key_begin + kAheadKeys), last};
  const T* ka[kKeyTile];
  const T* va[kKeyTile];
  for (int64_t t = 0; t < ntok; ++t) {
    const T* src = q + (q_row0 + it.tok_begin + t) * sh.q_stride + it.kv_head * G * D;
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < ND; ++j)
        store16(w.q.data() + (t * G + g) * D + j * kLanes,
                load16(src + g * D + j * kLanes) * sh.scale);
  }
  constexpr bool bf16_dot = has_bf16_dot() && std::is_same_v<T, c10::BFloat16> && ND % 2 == 0;
  if constexpr (bf16_dot) {
    for (int64_t t = 0; t < ntok; ++t)
        std::memcpy(w.qb.data() + t * G * D,
                    q + (q_row0 + it.tok_begin + t) * sh.q_stride + it.kv_head * G * D,
                    G * D * sizeof(T));
  }
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  const T* krows[kKeyTile];
  const T* vrows[kKeyTile];
  float corr[kMaxRows];
  for (int64_t kb = it.key_begin; kb < last; kb += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last - kb));
    const int na = take_keys(kc, vc, sh, ahead, after, nk, ka, va);
    kv_rows(kc, sh, table, it.kv_head, kb, nk, krows);
    kv_rows(vc, sh, table, it.kv_head, kb, nk, vrows);
    float* s = w.s.data();
#if !defined(__AVX512F__)
    if (true) {
      for (int k = 0; k < na; ++k) prefetch_key(ka[k], va[k], D * int64_t(sizeof(T)));
      scores_avx2<ND>(w.q.data(), rows, krows, nk, w.kt.data(), s);
    } else
#endif
    if (rows < 8) {
#if defined(__AVX512BF16__)
      if constexpr (bf16_dot)
        scores_by_dot_bf16<ND>(w.qb.data(), sh.scale, rows, krows, nk, s, ka, va, na);
      else
#endif
      {
        for (int k = 0; k < na; ++k) prefetch_key(ka[k], va[k], D * int64_t(sizeof(T)));
        scores_by_dot<ND>(w.q.data(), rows, krows, nk, w.kt.data(), s);
      }
    } else {  // many rows: a tile's arithmetic dwarfs its prefetches
      for (int k = 0; k < na; ++k) prefetch_key(ka[k], va[k], D * int64_t(sizeof(T)));
#if defined(__AVX512BF16__)
      if constexpr (bf16_dot)
        scores_by_tile_bf16<ND>(w.qb.data(), sh.scale, rows, krows, nk, w.kt.data(), s);
      else
#endif
        scores_by_tile<ND>(w.q.data(), rows, krows, nk, w.kt.data(), s);
    }
    bool paired = false;
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) {  // (kKeyTile even: the pairs never straddle tiles)
      pair_values<ND>(vrows, nk, reinterpret_cast<uint32_t*>(w.v.data()));
      paired = true;
    }
#endif
    if (!paired)
      for (int k = 0; k < nk; ++k)
        for (int j = 0; j < ND; ++j)
          store16(w.v.data() + k * D + j * kLanes, load16(vrows[k] + j * kLanes));
    softmax_rows(s, rows, G, pos0 - kb, nk, w, corr);
    int r = 0;
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) {
      accumulate_rows_bf16<ND>(w, rows, corr, nk);
      continue;
    }
#endif
#if !defined(__AVX512F__)
    for (; r < rows; ++r)
      accumulate_avx2<ND>(w.o.data() + r * D, s + r * kKeyTile, corr[r], w.v.data(), nk);
#else
    accumulate_rows<ND>(w, rows, r, corr, nk);
#endif
  }
}

// The same for a q8 cache (attention_q8.h): `kc`, `vc` are uint8 [kv_heads, num_blocks,
// block_size * (head_dim + 4)] (kv_q8.h).
template <int ND, typename T>
void attend_item(const AttnItem& it, const T* q, const uint8_t* kc, const uint8_t* vc,
                 const int32_t* table, int64_t ctx, int64_t q_len, int64_t q_row0,
                 const AttnShape& sh, AttnScratch& w, KeySpan after);
inline void prefetch_rows(const uint8_t* cache, const AttnShape& sh, const int32_t* table,
                          int64_t kvh, int64_t kb, int64_t ke);

// Splits the step into work items (see the file comment).
inline std::vector<AttnItem> plan_items(const int32_t* seq_lens, const int32_t* qstart,
                                        int64_t num_seqs, const AttnShape& sh, int threads) {
  const int64_t tok_tile = std::max<int64_t>(1, kMaxRows / sh.group);
  int64_t base = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    base += sh.num_kv_heads * ((qstart[s + 1] - qstart[s] + tok_tile - 1) / tok_tile);
  std::vector<AttnItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qstart[s + 1] - qstart[s], ctx = seq_lens[s];
    int64_t parts = 1;
    if (q_len > 0 && q_len <= tok_tile && base < 4 * threads && ctx >= 2 * kPartTokens)
      parts = std::min<int64_t>((ctx + kPartTokens - 1) / kPartTokens,
                                (4 * threads + base - 1) / base);
    int64_t span = ctx;
    if (parts > 1) {  // parts start on tile boundaries (so on block boundaries too)
      span = ((ctx + parts - 1) / parts + kKeyTile - 1) / kKeyTile * kKeyTile;
      parts = (ctx + span - 1) / span;
    }
    for (int64_t h = 0; h < sh.num_kv_heads; ++h)
      for (int64_t t = 0; t < q_len; t += tok_tile)
        for (int64_t p = 0; p < parts; ++p)
          items.push_back({int32_t(s), int32_t(h), int32_t(t), int32_t(std::min(q_len, t + tok_tile)),
                           int32_t(p * span), int32_t(std::min(ctx, (p + 1) * span)),
                           int32_t(parts == 1 ? -1 : p)});
  }
  return items;
}

// A step's work items and where the parts of split contexts keep their partial results.
struct AttnPlan {
  std::vector<AttnItem> items;
  std::vector<int64_t> part_base;                  // per item: first row in part_o, or -1
  std::vector<std::pair<size_t, size_t>> groups;   // item ranges merged into one output
  int64_t part_rows = 0;
  std::vector<float> part_o, part_lse;

  AttnPlan(const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
           const AttnShape& sh, int threads)
      : items(plan_items(seq_lens, qstart, num_seqs, sh, threads)), part_base(items.size(), -1) {
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

template <int ND, typename T, typename C>
void paged_attention_impl(T* out, const T* q, const C* kc, const C* vc, const int32_t* table,
                          const int32_t* seq_lens, const int32_t* qstart, int64_t num_seqs,
                          const AttnShape& sh) {
  const int threads = at::get_num_threads();
  AttnPlan plan(seq_lens, qstart, num_seqs, sh, threads);
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local AttnScratch w;
    w.reserve(sh.head_dim);
    run_items<ND>(plan, next, out, q, kc, vc, table, seq_lens, qstart, sh, w);
  });
  for (size_t g = 0; g < plan.groups.size(); ++g) merge_group<ND>(plan, g, out, qstart, sh);
}

}  // namespace tw

#include "attention_q8.h"
