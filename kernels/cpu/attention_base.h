// What every part of the CPU paged attention shares: the work item and shape types, the
// per-thread scratch, the tile constants, the key streams the prefetches run on, and the
// online-softmax step. attention.h has the layouts and the tile loop.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "vec.h"

namespace tw {

constexpr int kKeyTile = 64;        // keys per tile
constexpr int kTileVecs = kKeyTile / kLanes;
constexpr int kMaxRows = 64;        // query rows (tokens x group heads) per work item
// ... where they run on the matrix unit: its products cost little beside the key and
// value tiles each item stages (and reads from memory), so an item takes more rows
constexpr int kMaxRowsAmx = 512;
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
  // int8; attention_decode.h); the rest are prefill chunks, whatever their length
  int64_t num_decodes = std::numeric_limits<int64_t>::max();
  // > 0: sliding-window attention, the query at position p sees keys (p - window, p];
  // 0: every key up to its own
  int64_t window = 0;
  // per sequence, where set: the first key read (keys before it are another call's) and
  // the key read up to (exclusive), whatever the positions of the queries (cascade)
  const int32_t* key_start = nullptr;
  const int32_t* key_limit = nullptr;
  // where set: each query row's log-sum-exp of its scores, [tokens][num_heads]
  float* lse = nullptr;
};

// Per-thread scratch of one work item.
struct AttnScratch {
  std::vector<float> q, o, s, kt, v, m, l;
  std::vector<float> kq;          // a q8 cache's key tile as fp32 rows (kKeyTile x d)
  std::vector<c10::BFloat16> qb;  // bf16 queries, unscaled (the bf16 dot-product path)
  std::vector<uint16_t> pb;       // bf16 probabilities [rows][kKeyTile] (the AMX path)
  bool amx = false;               // the thread's tiles are configured: many rows use AMX
  void reserve(int64_t d, int64_t rows = kMaxRows) {  // rows: an item's most (grows only)
    if (static_cast<int64_t>(m.size()) >= rows && static_cast<int64_t>(kt.size()) >= d * kKeyTile)
      return;
    rows = std::max<int64_t>(rows, static_cast<int64_t>(m.size()));
    d = std::max<int64_t>(d, static_cast<int64_t>(kt.size()) / kKeyTile);
    q.resize(rows * d);
    qb.resize(rows * d);
    pb.resize(rows * kKeyTile);
    o.resize(rows * d);
    s.resize(rows * kKeyTile);
    kt.resize(d * kKeyTile);
    kq.resize(kKeyTile * d);
    v.resize(kKeyTile * d);
    m.resize(rows);
    l.resize(rows);
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

// The rows of one key tile as a row loader (attention_rows.h) hands them to the scoring
// and accumulation primitives (attention_isa.h): K and V row pointers, and the rows of
// the next na keys of the thread's stream to prefetch while this tile is scored.
template <typename R>
struct TileRows {
  const R* const* k;
  const R* const* v;
  const R* const* ka;
  const R* const* va;
  int na;
};

// Online-softmax update of one row's scores s[lo, seen) (the rest masked; lo < seen):
// leaves the probabilities in s and returns the factor by which the row's output must
// shrink. lo > 0 only where a sliding window starts inside the tile.
inline float softmax_update(float* s, int lo, int seen, float& m, float& l) {
  for (int k = 0; k < lo; ++k) s[k] = kNegInf;
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

// The first key of a tile starting at `kb` that a query at position `pos` sees under a
// sliding window (AttnShape::window; 0: none), relative to kb and at least 0.
inline int64_t window_lo(int64_t pos, int64_t window, int64_t kb) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1 - kb) : 0;
}

// The online-softmax step of a tile for each of `rows` query rows (token r / G of the
// item, whose position is `rel` + r / G relative to the tile's first key): causal, within
// the sliding window if there is one, and leaves the probabilities in s and each row's
// rescale factor in corr.
inline void softmax_rows(float* s, int rows, int64_t G, int64_t rel, int nk, int64_t window,
                         AttnScratch& w, float* corr) {
  for (int r = 0; r < rows; ++r) {
    const int64_t seen = std::min<int64_t>(nk, rel + r / G + 1);  // causal
    const int64_t lo = window_lo(rel + r / G, window, 0);
    if (seen <= lo) {  // nothing visible in this tile: p = 0, the output stays
      std::fill(s + r * kKeyTile, s + (r + 1) * kKeyTile, 0.0f);
      corr[r] = 1.0f;
    } else {
      corr[r] = softmax_update(s + r * kKeyTile, static_cast<int>(lo), static_cast<int>(seen),
                               w.m[r], w.l[r]);
    }
  }
}

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

#if defined(__AVX512F__)
// out[i][j] = in[j][i] for a 16 x 16 matrix of 32-bit values (in: its 16 rows; out rows
// `out_stride` apart, in 32-bit units).
inline void transpose16x16_epi32(const uint32_t* const* in, uint32_t* out, int64_t out_stride) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in[i]);
  transpose16x16(r);
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + j * out_stride, r[j]);  // column j
}

// The key tile as pairs of dims, kp[i][k] = (K[k][2 i], K[k][2 i + 1]) for keys k < nk
// and zeros up to the next multiple of 16 keys: the B operands of the scores (AMX), and
// the broadcast partners of the AVX512-BF16 tile (scores_by_tile_bf16).
template <int ND>
inline void pair_keys(const c10::BFloat16* const* krows, int nk, uint32_t* kp) {
  constexpr int NP = ND * kLanes / 2;  // pairs of dims a row
  static const uint32_t zeros[16] = {};
  for (int k0 = 0; k0 < nk; k0 += 16) {
    const uint32_t* rows[16];
    for (int k = 0; k < 16; ++k)
      rows[k] = k0 + k < nk ? reinterpret_cast<const uint32_t*>(krows[k0 + k]) : zeros;
    for (int i0 = 0; i0 < NP; i0 += 16) {
      const uint32_t* in[16];
      for (int k = 0; k < 16; ++k) in[k] = rows[k] == zeros ? zeros : rows[k] + i0;
      transpose16x16_epi32(in, kp + i0 * kKeyTile + k0, kKeyTile);
    }
  }
}

#endif

}  // namespace tw
