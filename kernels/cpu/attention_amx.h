// The CPU attention tile loop's products on the matrix unit (AMX-BF16), for work items with
// many query rows (prefill chunks, speculative verification rows, GQA groups stacked as
// rows): a key tile's scores S = Q K^T and its P V as bf16 tile products with fp32
// accumulation. The online softmax between them stays the AVX-512 one (attention_base.h),
// so the numbers differ from the vdpbf16ps path only in the order of the fp32 sums.
//
// Operands (tiles of 16 rows x 64 bytes, amx.h):
//   S = Q K^T   A: 16 query rows x 32 dims of the bf16 queries, loaded where they are staged;
//               B: the key tile as 32-bit pairs of dims, kp[d / 2][kKeyTile] (16 keys of
//               one pair row a tile row), made by pair_keys;
//               C: 16 rows x 16 keys in fp32, stored into the scores.
//   O += P V    A: 16 rows x 32 keys of the probabilities rounded to bf16;
//               B: the V tile by pairs of keys, vp[k / 2][D] (pair_values);
//               C: 16 rows x 16 dims of the output, loaded from o after its rescale.
// Four accumulators (2 row blocks x 2 column blocks) use tiles 0-3, the A operands 4-5
// and the B operands 6-7: each loaded operand feeds two products.
#pragma once

#include "amx.h"
#include "attention_base.h"

#if defined(TW_AMX) && defined(__AVX512BF16__)
#define TW_ATTN_AMX 1

namespace tw {

// exp(x) for x <= 0 with a degree-4 polynomial for 2^f on [-0.5, 0.5] (fitted to its
// relative error: under 4e-6): for probabilities that are rounded to bf16 (2^-9) on their way to P V.
// Arguments at or under -87 give 0 (as vexp).
inline __m512 exp_for_bf16(__m512 x) {
  static constexpr float kDegree4[] = {9.6004024e-3f, 5.5916936e-2f, 2.4023719e-1f,
                                       6.9312199e-1f, 1.0f};
  return exp_by_poly(x, kDegree4);
}

// Scores of query rows [r0, r1) (bf16 [row][D] in qb; r0 a multiple of 16) against the
// key tile kp (pair_keys; nk keys), unscaled, into s [row][kKeyTile]. Rows up to the next
// multiple of 16 are computed too (from whatever qb holds there) and left unused.
template <int ND>
inline void scores_amx(const c10::BFloat16* qb, int r0, int r1, const uint32_t* kp, int nk,
                       float* s) {
  constexpr int D = ND * kLanes, NC = D / 32;
  const int rb_n = (r1 + 15) / 16, kb_n = (nk + 15) / 16;
  for (int rb = r0 / 16; rb < rb_n; rb += 2) {
    const bool two_r = rb + 1 < rb_n;
    for (int kb = 0; kb < kb_n; kb += 2) {
      const bool two_k = kb + 1 < kb_n;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < NC; ++c) {
        _tile_loadd(4, qb + rb * 16 * D + c * 32, D * 2);
        _tile_loadd(6, kp + c * 16 * kKeyTile + kb * 16, kKeyTile * 4);
        _tile_dpbf16ps(0, 4, 6);
        if (two_r) {
          _tile_loadd(5, qb + (rb + 1) * 16 * D + c * 32, D * 2);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (two_k) {
          _tile_loadd(7, kp + c * 16 * kKeyTile + (kb + 1) * 16, kKeyTile * 4);
          _tile_dpbf16ps(2, 4, 7);
          if (two_r) _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* out = s + rb * 16 * kKeyTile + kb * 16;
      _tile_stored(0, out, kKeyTile * 4);
      if (two_r) _tile_stored(1, out + 16 * kKeyTile, kKeyTile * 4);
      if (two_k) _tile_stored(2, out + 16, kKeyTile * 4);
      if (two_r && two_k) _tile_stored(3, out + 16 * kKeyTile + 16, kKeyTile * 4);
    }
  }
}

// The online-softmax step of a key tile for query rows [r0, rows) (as softmax_rows, on
// unscaled scores s [row][kKeyTile] from scores_amx): the rows' scaled scores and new
// maxima, the factors by which their outputs shrink (one vector exp for 16 rows), then
// their probabilities rounded to bf16 into w.pb (the A operands of P V; zeros for masked
// keys and for the rows past `rows` up to a multiple of 16) and the output rows in w.o
// rescaled where their maximum moved.
template <int ND>
inline void softmax_amx(AttnScratch& w, float scale, int r0, int rows, int64_t G, int64_t rel,
                        int nk, int64_t window) {
  constexpr int D = ND * kLanes;
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float* s = w.s.data();
  uint16_t* pb = w.pb.data();
  float* o = w.o.data();
  const int padded = (rows + 15) / 16 * 16;
  alignas(64) float change[kMaxRowsAmx];  // m - m_new a row (then the factor exp of it)
  bool visible[kMaxRowsAmx];
  // the rows' scores scaled (masked keys -inf) and their new maxima
  for (int r = r0; r < rows; ++r) {
    const int64_t seen = std::min<int64_t>(nk, rel + r / G + 1);  // causal
    const int64_t lo = window_lo(rel + r / G, window, 0);
    visible[r] = seen > lo;
    change[r] = 0.0f;
    if (!visible[r]) continue;  // nothing visible in this tile: p = 0, the output stays
    __m512 mx = ninf;
    for (int c = 0; c < kTileVecs; ++c) {
      const __m512i k = _mm512_add_epi32(iota, _mm512_set1_epi32(c * kLanes));
      const __mmask16 live = _mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(int(lo))) &
                             _mm512_cmplt_epi32_mask(k, _mm512_set1_epi32(int(seen)));
      float* sr = s + r * kKeyTile + c * kLanes;
      const __m512 x = _mm512_mask_mul_ps(ninf, live, _mm512_loadu_ps(sr), sc);
      _mm512_storeu_ps(sr, x);
      mx = _mm512_max_ps(mx, x);
    }
    const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(mx));
    change[r] = w.m[r] - m_new;  // -inf on the first visible tile: the factor is 0
    w.m[r] = m_new;
  }
  for (int r = rows; r < padded; ++r) change[r] = 0.0f;
  for (int r = r0; r < padded; r += kLanes)  // exp of 16 rows' changes at once
    _mm512_store_ps(change + r, (__m512)vexp((f32x16)_mm512_load_ps(change + r)));
  for (int r = r0; r < rows; ++r) {
    uint16_t* dst = pb + r * kKeyTile;
    if (!visible[r]) {
      std::memset(dst, 0, kKeyTile * 2);
      continue;
    }
    const __m512 mn = _mm512_set1_ps(w.m[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < kTileVecs; c += 2) {
      const float* sr = s + r * kKeyTile + c * kLanes;
      const __m512 p0 = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(sr), mn));
      const __m512 p1 = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(sr + kLanes), mn));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(dst + c * kLanes, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    const float corr = change[r];
    w.l[r] = w.l[r] * corr + _mm512_reduce_add_ps(sum);
    if (corr != 1.0f) {
      const __m512 f = _mm512_set1_ps(corr);
      for (int j = 0; j < ND; ++j)
        _mm512_storeu_ps(o + r * D + j * kLanes,
                         _mm512_mul_ps(f, _mm512_loadu_ps(o + r * D + j * kLanes)));
    }
  }
  for (int r = rows; r < padded; ++r) std::memset(pb + r * kKeyTile, 0, kKeyTile * 2);
}

// o += P V for rows [r0, r1) (r0 a multiple of 16): P the bf16 probabilities in pb
// (softmax_amx; zero past nk), V the tile by key pairs in vp (pair_values, the pairs past
// nk zero up to a multiple of 32 keys: see tile_amx).
template <int ND>
inline void accumulate_amx(float* o, int r0, int r1, const uint32_t* vp, int nk,
                           const uint16_t* pb) {
  constexpr int D = ND * kLanes;
  const int rb_n = (r1 + 15) / 16, kc_n = (nk + 31) / 32;
  for (int rb = r0 / 16; rb < rb_n; rb += 2) {
    const bool two_r = rb + 1 < rb_n;
    for (int db = 0; db < ND; db += 2) {  // ND even: column blocks in pairs
      float* out = o + rb * 16 * D + db * 16;
      _tile_loadd(0, out, D * 4);
      _tile_loadd(2, out + 16, D * 4);
      if (two_r) {
        _tile_loadd(1, out + 16 * D, D * 4);
        _tile_loadd(3, out + 16 * D + 16, D * 4);
      }
      for (int kc = 0; kc < kc_n; ++kc) {
        _tile_loadd(4, pb + rb * 16 * kKeyTile + kc * 32, kKeyTile * 2);
        _tile_loadd(6, vp + kc * 16 * D + db * 16, D * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vp + kc * 16 * D + (db + 1) * 16, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        if (two_r) {
          _tile_loadd(5, pb + (rb + 1) * 16 * kKeyTile + kc * 32, kKeyTile * 2);
          _tile_dpbf16ps(1, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, out, D * 4);
      _tile_stored(2, out + 16, D * 4);
      if (two_r) {
        _tile_stored(1, out + 16 * D, D * 4);
        _tile_stored(3, out + 16 * D + 16, D * 4);
      }
    }
  }
}

// A key tile (keys krows, the V tile paired in w.v by pair_values) for query rows
// [0, rows) of the item: the keys paired, then the scores, softmax and P V of every row.
template <int ND>
inline void tile_amx(AttnScratch& w, float scale, int rows, int64_t G, int64_t rel, int nk,
                     int64_t window, const c10::BFloat16* const* krows) {
  constexpr int D = ND * kLanes;
  uint32_t* kp = reinterpret_cast<uint32_t*>(w.kt.data());
  uint32_t* vp = reinterpret_cast<uint32_t*>(w.v.data());
  pair_keys<ND>(krows, nk, kp);
  // pairs past nk up to 32 keys: zeros, so that stale values never meet a zero
  // probability (0 x NaN)
  for (int k2 = (nk + 1) / 2; k2 < (nk + 31) / 32 * 16; ++k2) std::memset(vp + k2 * D, 0, D * 4);
  // each phase over every row before the next: a tile load of lines that vector stores
  // just wrote (or a vector load of a tile store's) waits for them, and phases slab by
  // slab were slower (measured: 0.84-0.96x of phases over the whole item)
  scores_amx<ND>(w.qb.data(), 0, rows, kp, nk, w.s.data());
  softmax_amx<ND>(w, scale, 0, rows, G, rel, nk, window);
  accumulate_amx<ND>(w.o.data(), 0, rows, vp, nk, w.pb.data());
}

}  // namespace tw
#endif
