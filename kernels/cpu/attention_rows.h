// Row loaders of the CPU attention tile loop (attention.h): a small type per KV cache
// format that hands the loop each tile's K and V rows (TileRows), prefetches the keys
// ahead of it, and says which items a whole decode kernel (attention_decode.h) takes
// instead. A new cache format is a new loader and a RowLoader specialization; the loop
// and the ISA primitives (attention_isa.h) stay as they are.
//   CacheRows<T>  bf16 or fp32 caches [kv_heads, num_blocks, block_size, head_dim]: rows
//                 read in place; the keys kAheadKeys on asked for while a tile is scored
//   Q8Rows<Row>   q8 caches (kv_q8.h): each tile dequantized into scratch rows of Row
//                 (bf16 for the bf16 primitives, the values a bf16 cache would hold;
//                 else fp32); the next tile prefetched in one go
#pragma once

#include <type_traits>

#include "attention_base.h"
#include "attention_decode.h"
#include "kv_q8.h"

namespace tw {

template <typename T>
struct CacheRows {
  static constexpr bool kValuesStaged = false;  // the ISA stages the V tile from the rows
  const T* kc;
  const T* vc;
  const AttnShape& sh;
  const int32_t* table;
  int64_t kv_head;
  // The stream of keys one tile ahead: this item's after its first tile (that one was
  // asked for by whatever ran before), then the next item's (`after`).
  KeySpan ahead, after;
  const T* krows[kKeyTile];
  const T* vrows[kKeyTile];
  const T* ka[kKeyTile];
  const T* va[kKeyTile];

  CacheRows(const T* k, const T* v, const AttnShape& s, const int32_t* tab, const AttnItem& it,
            int64_t last, KeySpan next, AttnScratch&)
      : kc(k), vc(v), sh(s), table(tab), kv_head(it.kv_head),
        ahead{tab, it.kv_head, std::min<int64_t>(last, it.key_begin + kAheadKeys), last},
        after(next) {}

  // Keys [kb, kb + nk), and the next keys of the stream to prefetch.
  template <int ND>
  TileRows<T> tile(int64_t kb, int nk) {
    const int na = take_keys(kc, vc, sh, ahead, after, nk, ka, va);
    kv_rows(kc, sh, table, kv_head, kb, nk, krows);
    kv_rows(vc, sh, table, kv_head, kb, nk, vrows);
    return {krows, vrows, ka, va, na};
  }

  // Runs the item as a whole decode kernel where this build has one for it; `first`: the
  // first key a one-token item's query sees (its sliding window's start; <= 0: none).
  template <int ND, typename Q>
  static bool decode(const AttnItem& it, const Q* q, const T* kc, const T* vc,
                     const int32_t* table, int64_t first, int64_t last, int64_t q_len,
                     int64_t q_row, const AttnShape& sh, AttnScratch& w, KeySpan after) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, T> && ND % 2 == 0) {
      if (it.tok_end - it.tok_begin == 1 && sh.group <= 8 && sh.block_size % kLanes == 0 &&
          it.key_begin % kLanes == 0) {
        attend_decode_bf16<ND>(it, q, kc, vc, table, first, last, q_row, sh, w, after);
        return true;
      }
    }
#endif
    (void)it, (void)q, (void)kc, (void)vc, (void)table, (void)first, (void)last, (void)q_len,
        (void)q_row, (void)sh, (void)w, (void)after;
    return false;
  }
};

// Asks for keys [kb, ke) of one KV head of a q8 cache: each key's K and V codes and the
// lines holding their scales.
inline void prefetch_rows(const uint8_t* cache, const AttnShape& sh, const int32_t* table,
                          int64_t kvh, int64_t kb, int64_t ke) {
  const Q8Layout lay = q8_layout(sh);
  const int64_t bs = sh.block_size;
  for (int64_t pos = kb; pos < ke;) {
    const int64_t off = pos % bs, n = std::min(bs - off, ke - pos);
    const char* blk = reinterpret_cast<const char*>(cache + lay.block_offset(kvh, table[pos / bs]));
    for (int64_t b = lay.codes(off); b < lay.codes(off + n); b += 64) __builtin_prefetch(blk + b, 0, 2);
    for (int64_t b = lay.scale(off); b < lay.scale(off + n); b += 64) __builtin_prefetch(blk + b, 0, 2);
    pos += n;
  }
}

// Keys [kb, kb + nk) of one KV head as rows dst[nk][D] (codes times scales, in fp32, then
// rounded to Out); K codes are biased (kv_q8.h).
template <int ND, bool kBiased, typename Out>
inline void q8_dequantize_rows(const uint8_t* cache, const AttnShape& sh, const int32_t* table,
                               int64_t kvh, int64_t kb, int nk, Out* dst) {
  constexpr int D = ND * kLanes;
  const Q8Layout lay = q8_layout(sh);
  const int64_t bs = sh.block_size;
  for (int k = 0; k < nk; ++k) {
    const int64_t pos = kb + k, off = pos % bs;
    const uint8_t* blk = cache + lay.block_offset(kvh, table[pos / bs]);
    const uint8_t* codes = blk + lay.codes(off);
    float scale;
    std::memcpy(&scale, blk + lay.scale(off), sizeof(scale));
    for (int j = 0; j < ND; ++j)
      store16(dst + k * D + j * kLanes,
              (kBiased ? load16_k(codes + j * kLanes) : load16_v(codes + j * kLanes)) * scale);
  }
}


template <typename Row>
struct Q8Rows {
  // fp32 rows are dequantized straight into the V tile the fp32 primitives read
  static constexpr bool kValuesStaged = std::is_same_v<Row, float>;
  const uint8_t* kc;
  const uint8_t* vc;
  const AttnShape& sh;
  const int32_t* table;
  int64_t kv_head, last;
  KeySpan after;
  Row* kbuf;
  Row* vbuf;
  const Row* krows[kKeyTile];
  const Row* vrows[kKeyTile];

  // w.kq holds the K tile's rows, and for bf16 the V tile's rows after them
  Q8Rows(const uint8_t* k, const uint8_t* v, const AttnShape& s, const int32_t* tab,
         const AttnItem& it, int64_t end, KeySpan next, AttnScratch& w)
      : kc(k), vc(v), sh(s), table(tab), kv_head(it.kv_head), last(end), after(next),
        kbuf(reinterpret_cast<Row*>(w.kq.data())),
        vbuf(kValuesStaged ? reinterpret_cast<Row*>(w.v.data()) : kbuf + kKeyTile * s.head_dim) {
    for (int k = 0; k < kKeyTile; ++k) {
      krows[k] = kbuf + k * s.head_dim;
      vrows[k] = vbuf + k * s.head_dim;
    }
  }

  // Keys [kb, kb + nk) dequantized; the next tile of this item, else the start of the
  // next item, asked for first.
  template <int ND>
  TileRows<Row> tile(int64_t kb, int nk) {
    const int64_t nb = kb + kKeyTile;
    if (nb < last) {
      prefetch_rows(kc, sh, table, kv_head, nb, std::min<int64_t>(last, nb + kKeyTile));
      prefetch_rows(vc, sh, table, kv_head, nb, std::min<int64_t>(last, nb + kKeyTile));
    } else if (after.begin < after.end) {
      const int64_t e = std::min<int64_t>(after.end, after.begin + kKeyTile);
      prefetch_rows(kc, sh, after.table, after.kv_head, after.begin, e);
      prefetch_rows(vc, sh, after.table, after.kv_head, after.begin, e);
    }
    q8_dequantize_rows<ND, true>(kc, sh, table, kv_head, kb, nk, kbuf);
    q8_dequantize_rows<ND, false>(vc, sh, table, kv_head, kb, nk, vbuf);
    return {krows, vrows, krows, vrows, 0};
  }

  // Decode steps only (AttnShape::num_decodes), not a prefill chunk of one token: the
  // queries that go through int8 are exactly the decode steps'.
  template <int ND, typename Q>
  static bool decode(const AttnItem& it, const Q* q, const uint8_t* kc, const uint8_t* vc,
                     const int32_t* table, int64_t first, int64_t last, int64_t q_len,
                     int64_t q_row, const AttnShape& sh, AttnScratch& w, KeySpan after) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (ND * kLanes % 64 == 0) {
      if (q_len == 1 && it.seq < sh.num_decodes && sh.group <= 8 &&
          sh.block_size % kLanes == 0 && it.key_begin % kLanes == 0) {
        attend_decode_q8<ND>(it, q, kc, vc, table, first, last, q_row, sh, w, after);
        return true;
      }
    }
#endif
    (void)it, (void)q, (void)kc, (void)vc, (void)table, (void)first, (void)last, (void)q_len,
        (void)q_row, (void)sh, (void)w, (void)after;
    return false;
  }
};

// The loader of a cache whose elements are C, for primitives that take rows of Row.
template <typename C, typename Row>
struct RowLoaderFor {
  using type = CacheRows<C>;
};
template <typename Row>
struct RowLoaderFor<uint8_t, Row> {
  using type = Q8Rows<Row>;
};
template <typename C, typename Row>
using RowLoader = typename RowLoaderFor<C, Row>::type;

}  // namespace tw
