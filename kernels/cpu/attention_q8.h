// Paged attention over a q8 cache (layout: kv_q8.h), the work items of attention.h.
//
// Decode items (sequences of one query token, a group of at most 8 heads, head_dim a
// multiple of 64, block sizes a multiple of 16) on CPUs with AVX512-VNNI take
// attend_decode_q8: each query row is itself quantized to int8 codes (per row, like the
// cache rows), and its scores against 16 keys are integer dot products of codes
// (vpdpbusd: 64 byte products an instruction) times the two scales. V rows are widened
// to fp32 and weighted by the probabilities times their scales. Every other item
// (prefill chunks, other shapes) dequantizes each 64-key tile into fp32 rows and runs the
// fp32 code of attention.h.
#pragma once

#include "attention.h"
#include "kv_q8.h"

namespace tw {

inline Q8Layout q8_layout(const AttnShape& sh) {
  return {sh.num_blocks, sh.block_size, sh.head_dim};
}

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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int ND, typename T>
void attend_decode_q8(const AttnItem& it, const T* q, const uint8_t* kc, const uint8_t* vc,
                      const int32_t* table, int64_t last, int64_t q_row, const AttnShape& sh,
                      AttnScratch& w, KeySpan after);
#endif

template <int ND, typename T>
void attend_item(const AttnItem& it, const T* q, const uint8_t* kc, const uint8_t* vc,
                 const int32_t* table, int64_t ctx, int64_t q_len, int64_t q_row0,
                 const AttnShape& sh, AttnScratch& w, KeySpan after) {
  constexpr int D = ND * kLanes;
  const int64_t G = sh.group, ntok = it.tok_end - it.tok_begin;
  const int rows = static_cast<int>(ntok * G);
  const int64_t pos0 = ctx - q_len + it.tok_begin;
  const int64_t last = std::min<int64_t>(it.key_end, pos0 + ntok);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (D % 64 == 0) {
    // decode steps only (AttnShape::num_decodes), not a prefill chunk of one token: the
    // queries that go through int8 are exactly the decode steps'
    if (q_len == 1 && it.seq < sh.num_decodes && G <= 8 && sh.block_size % kLanes == 0 &&
        it.key_begin % kLanes == 0) {
      attend_decode_q8<ND>(it, q, kc, vc, table, last, q_row0 + it.tok_begin, sh, w, after);
      return;
    }
  }
#endif
  // bf16 activations: tiles dequantized to bf16 rows (the values a bf16 cache would
  // hold) for the bf16 dot-product code; fp32: fp32 rows for the fp32 code
  constexpr bool bf16_dot = has_bf16_dot() && std::is_same_v<T, c10::BFloat16> && ND % 2 == 0;
  using Row = std::conditional_t<bf16_dot, c10::BFloat16, float>;
  for (int64_t t = 0; t < ntok; ++t) {
    const T* src = q + (q_row0 + it.tok_begin + t) * sh.q_stride + it.kv_head * G * D;
    if constexpr (bf16_dot) {
      std::memcpy(w.qb.data() + t * G * D, src, G * D * sizeof(T));
      continue;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < ND; ++j)
        store16(w.q.data() + (t * G + g) * D + j * kLanes,
                load16(src + g * D + j * kLanes) * sh.scale);
  }
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  // w.kq holds the K tile's rows, and for bf16 the V tile's rows after them
  Row* kbuf = reinterpret_cast<Row*>(w.kq.data());
  Row* vbuf = bf16_dot ? kbuf + kKeyTile * D : reinterpret_cast<Row*>(w.v.data());
  const Row* krows[kKeyTile];
  const Row* vrows[kKeyTile];
  for (int k = 0; k < kKeyTile; ++k) {
    krows[k] = kbuf + k * D;
    vrows[k] = vbuf + k * D;
  }
  float corr[kMaxRows];
  for (int64_t kb = it.key_begin; kb < last; kb += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last - kb));
    // the next tile of this item, else the start of the next item
    const int64_t nb = kb + kKeyTile;
    if (nb < last) {
      prefetch_rows(kc, sh, table, it.kv_head, nb, std::min<int64_t>(last, nb + kKeyTile));
      prefetch_rows(vc, sh, table, it.kv_head, nb, std::min<int64_t>(last, nb + kKeyTile));
    } else if (after.begin < after.end) {
      const int64_t e = std::min<int64_t>(after.end, after.begin + kKeyTile);
      prefetch_rows(kc, sh, after.table, after.kv_head, after.begin, e);
      prefetch_rows(vc, sh, after.table, after.kv_head, after.begin, e);
    }
    q8_dequantize_rows<ND, true>(kc, sh, table, it.kv_head, kb, nk, kbuf);
    q8_dequantize_rows<ND, false>(vc, sh, table, it.kv_head, kb, nk, vbuf);
    float* s = w.s.data();
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) {
      if (rows < 8)
        scores_by_dot_bf16<ND>(w.qb.data(), sh.scale, rows, krows, nk, s, krows, vrows, 0);
      else
        scores_by_tile_bf16<ND>(w.qb.data(), sh.scale, rows, krows, nk, w.kt.data(), s);
      pair_values<ND>(vrows, nk, reinterpret_cast<uint32_t*>(w.v.data()));
      softmax_rows(s, rows, G, pos0 - kb, nk, w, corr);
      accumulate_rows_bf16<ND>(w, rows, corr, nk);
      continue;
    }
#endif
    if constexpr (!bf16_dot) {
      if (rows < 8)
        scores_by_dot<ND>(w.q.data(), rows, krows, nk, w.kt.data(), s);
      else
        scores_by_tile<ND>(w.q.data(), rows, krows, nk, w.kt.data(), s);
      softmax_rows(s, rows, G, pos0 - kb, nk, w, corr);
      accumulate_rows<ND>(w, rows, 0, corr, nk);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 fp32 values of a query row as int8 codes (round(x / div), as q8_store_row).
inline __m128i q8_codes16(f32x16 x, float div) {
  const __m512i c = _mm512_cvtps_epi32((__m512)round_even(x / div));
  return _mm512_cvtsepi32_epi8(c);  // |c| <= 127: no saturation happens
}

// The decode work item over a q8 cache (see the file comment). Keys go by 16-key chunks
// that lie in one block each; each chunk's 16 scores come from 16 integer dot products
// reduced at once (hsum16 on int32 lanes). The query row's codes c_q with scale s_q
// against a key's biased codes u = c_k + 128 with scale s_k give
// q.k ~ s_q s_k (sum c_q u - 128 sum c_q).
template <int ND, typename T>
void attend_decode_q8(const AttnItem& it, const T* q, const uint8_t* kc, const uint8_t* vc,
                      const int32_t* table, int64_t last, int64_t q_row, const AttnShape& sh,
                      AttnScratch& w, KeySpan after) {
  constexpr int D = ND * kLanes, NQ = D / 64;
  const int G = static_cast<int>(sh.group);
  const int64_t bs = sh.block_size;
  const Q8Layout lay = q8_layout(sh);
  const T* qrow = q + q_row * sh.q_stride + it.kv_head * G * D;
  __m512i qv[8][NQ];
  float qscale[8];
  int32_t qbias[8];  // 128 * the sum of the row's codes
  for (int r = 0; r < G; ++r) {
    f32x16 x[ND], amax = splat(0.0f);
    for (int j = 0; j < ND; ++j) {
      x[j] = load16(qrow + r * D + j * kLanes);
      amax = vmax(amax, x[j] < 0 ? -x[j] : x[j]);
    }
    const float s = hmax(amax) / kQ8Max, div = s > 0.0f ? s : 1.0f;
    int32_t sum = 0;
    for (int j = 0; j < NQ; ++j) {
      alignas(64) __m128i parts[4];  // 64 codes, then one load (no lane-indexed inserts)
      for (int u = 0; u < 4; ++u) {
        parts[u] = q8_codes16(x[4 * j + u], div);
        sum += _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(parts[u]));
      }
      qv[r][j] = _mm512_load_si512(parts);
    }
    qscale[r] = s * sh.scale;
    qbias[r] = 128 * sum;
  }
  float m[8], l[8];
  f32x16 o[8][ND];
  for (int r = 0; r < G; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
    for (int j = 0; j < ND; ++j) o[r][j] = splat(0.0f);
  }
  ChunkCursor ahead{{table, it.kv_head, std::min<int64_t>(last, it.key_begin + kAheadKeys), last},
                    after};
  alignas(64) float s[8][kKeyTile];
  alignas(64) float vscale[kKeyTile];
  const uint8_t* vchunk[kTileVecs];  // each chunk's first V row
  for (int64_t kb = it.key_begin; kb < last; kb += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, last - kb));
    const int chunks = (nk + kLanes - 1) / kLanes;
    for (int c = 0; c < chunks; ++c) {
      const int64_t pos = kb + c * kLanes, off = pos % bs;
      const int64_t blk = lay.block_offset(it.kv_head, table[pos / bs]);
      const uint8_t* kp = kc + blk + lay.codes(off);
      const f32x16 kscale = load16(reinterpret_cast<const float*>(kc + blk + lay.scale(off)));
      store16(vscale + c * kLanes, load16(reinterpret_cast<const float*>(vc + blk + lay.scale(off))));
      vchunk[c] = vc + blk + lay.codes(off);
      const int n = std::min(kLanes, nk - c * kLanes);
      int an = 0;
      int64_t ablk = 0, aoff = 0;
      ahead.next_q8(sh, an, ablk, aoff);
      const uint8_t* krow[kLanes];
      for (int k = 0; k < kLanes; ++k) krow[k] = kp + std::min(k, n - 1) * D;  // past n: masked
      for (int r = 0; r < G; ++r) {
        i32x16 acc[kLanes];
#pragma GCC unroll 16
        for (int k = 0; k < kLanes; ++k) {
          __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(krow[k]),
                                          qv[r][0]);
          for (int j = 1; j < NQ; ++j)
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(krow[k] + j * 64), qv[r][j]);
          acc[k] = (i32x16)a;
        }
        const i32x16 dots = hsum16(acc) - qbias[r];
        store16(s[r] + c * kLanes, __builtin_convertvector(dots, f32x16) * kscale * qscale[r]);
        // this row's share of the chunk kAheadKeys ahead, between rows' arithmetic
        if (an > 0) {
          const int k0 = r * an / G, k1 = (r + 1) * an / G;
          for (const uint8_t* cache : {kc, vc}) {
            const char* p = reinterpret_cast<const char*>(cache + ablk);
            for (int64_t b = lay.codes(aoff + k0); b < lay.codes(aoff + k1); b += 64)
              __builtin_prefetch(p + b, 0, 3);
            if (r == 0) __builtin_prefetch(p + lay.scale(aoff), 0, 3);
          }
        }
      }
    }
    float corr[8];
    for (int r = 0; r < G; ++r) {
      corr[r] = softmax_update(s[r], nk, m[r], l[r]);
      for (int c = 0; c < chunks; ++c)  // the probabilities times the V rows' scales
        store16(s[r] + c * kLanes, load16(s[r] + c * kLanes) * load16(vscale + c * kLanes));
      for (int j = 0; j < ND; ++j) o[r][j] *= corr[r];
    }
    for (int k = 0; k < nk; ++k) {
      const int8_t* vr =
          reinterpret_cast<const int8_t*>(vchunk[k / kLanes]) + (k % kLanes) * D;
      f32x16 vf[ND];
      for (int j = 0; j < ND; ++j) vf[j] = load16(vr + j * kLanes);
      for (int r = 0; r < G; ++r) {
        const float p = s[r][k];
        for (int j = 0; j < ND; ++j) o[r][j] += p * vf[j];
      }
    }
  }
  for (int r = 0; r < G; ++r) {
    w.m[r] = m[r];
    w.l[r] = l[r];
    for (int j = 0; j < ND; ++j) store16(w.o.data() + r * D + j * kLanes, o[r][j]);
  }
}
#endif

}  // namespace tw
