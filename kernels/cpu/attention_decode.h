// Whole decode work items (one query token, its group's G <= 8 heads as rows, block
// sizes a multiple of 16) on AVX-512 CPUs, each a kernel of its own rather than a tile
// loader: they keep the rows' outputs in registers across the whole context and address
// keys by 16-key chunks, one block each.
//   attend_decode_bf16  bf16 caches, AVX512-BF16
//   attend_decode_q8    q8 caches (layout: kv_q8.h), AVX512-VNNI: each query row is
//                       itself quantized to int8 codes (per row, like the cache rows),
//                       and its scores against 16 keys are integer dot products of codes
//                       (vpdpbusd: 64 byte products an instruction) times the two
//                       scales; V rows are widened to fp32 and weighted by the
//                       probabilities times their scales.
// Both read keys [it.key_begin, last), and a query under a sliding window masks those
// below `first` (only in the first tile: key_begin is first rounded down to 16 keys).
// The row loaders (attention_rows.h) say which items take them; every other item runs
// the tile loop of attention.h.
#pragma once

#include "attention_base.h"
#include "kv_q8.h"

namespace tw {

inline Q8Layout q8_layout(const AttnShape& sh) {
  return {sh.num_blocks, sh.block_size, sh.head_dim};
}

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
                        const c10::BFloat16* vc, const int32_t* table, int64_t first,
                        int64_t last, int64_t q_row, const AttnShape& sh, AttnScratch& w,
                        KeySpan after) {
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
    const int lo = static_cast<int>(std::max<int64_t>(0, first - kb));  // (< nk)
    for (int r = 0; r < G; ++r) corr[r] = softmax_update(s[r], lo, nk, m[r], l[r]);
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
                      const int32_t* table, int64_t first, int64_t last, int64_t q_row,
                      const AttnShape& sh, AttnScratch& w, KeySpan after) {
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
    const int lo = static_cast<int>(std::max<int64_t>(0, first - kb));  // (< nk)
    for (int r = 0; r < G; ++r) {
      corr[r] = softmax_update(s[r], lo, nk, m[r], l[r]);
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
