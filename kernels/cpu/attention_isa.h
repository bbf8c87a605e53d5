// The ISA primitives of the CPU attention tile loop (attention.h): how a tile's scores
// and its P V product are computed, in three sets, one picked per build by AttnIsa:
//   AttnF32x8    8-lane fp32 vectors (CPUs without AVX-512: AVX2 registers hold 8)
//   AttnF32x16   16-lane fp32 vectors (AVX-512)
//   AttnBf16Dot  bf16 pairs summed in fp32 by vdpbf16ps (AVX512-BF16; bf16 activations)
// Each set reads key rows of any element type a row loader hands it (attention_rows.h)
// and has the same members: Row (what a dequantizing loader should produce),
// stage_queries, whole_tile (a tile done in one go, where a set has a way to: false
// otherwise), scores, stage_values and accumulate. Where the CPU has AMX, AttnBf16Dot
// runs items of many rows on the matrix unit (attention_amx.h).
#pragma once

#include <cstring>
#include <type_traits>

#include "attention_amx.h"
#include "attention_base.h"

namespace tw {

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
  pair_keys<ND>(krows, nk, kp);  // 16 x 16 transposes in registers
  const int filled = (nk + 15) / 16 * 16;  // (zeros from nk up to here)
  if (filled < kKeyTile)
    for (int i = 0; i < NP; ++i)
      std::memset(kp + i * kKeyTile + filled, 0, (kKeyTile - filled) * sizeof(uint32_t));
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

// The V tile by pairs of keys, vp[k / 2][D] of 32-bit (bf16 V[k][d], V[k + 1][d]) pairs,
// a missing last key as zeros: what accumulate_pv_bf16 reads.
template <int ND>
inline void pair_values(const c10::BFloat16* const* vrows, int nk, uint32_t* vp) {
  constexpr int D = ND * kLanes;  // a multiple of 32 (ND even)
  // 16-bit lanes: (a[i], b[i]) for i in [0, 16), then for i in [16, 32)
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                               7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44,
                                               13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                               22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                               28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int k = 0; k < nk; k += 2) {
    const c10::BFloat16* a = vrows[k];
    const c10::BFloat16* b = k + 1 < nk ? vrows[k + 1] : nullptr;
    uint32_t* dst = vp + (k / 2) * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
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

// The fp32 query rows of an item, scaled: w.q[t * G + g] = q[token t][head g] * scale.
template <int ND, typename T>
inline void stage_queries_f32(const T* q, int64_t ntok, int64_t G, int64_t stride,
                              float scale, AttnScratch& w) {
  constexpr int D = ND * kLanes;
  for (int64_t t = 0; t < ntok; ++t)
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < ND; ++j)
        store16(w.q.data() + (t * G + g) * D + j * kLanes,
                load16(q + t * stride + g * D + j * kLanes) * scale);
}

// The V tile as fp32 rows in w.v.
template <int ND, typename R>
inline void stage_values_f32(const R* const* vrows, int nk, AttnScratch& w) {
  constexpr int D = ND * kLanes;
  for (int k = 0; k < nk; ++k)
    for (int j = 0; j < ND; ++j)
      store16(w.v.data() + k * D + j * kLanes, load16(vrows[k] + j * kLanes));
}

// Asks for the K and V rows of the tile's next keys (TileRows::ka, va) in one go.
template <int ND, typename R>
inline void prefetch_ahead(const TileRows<R>& t) {
  for (int k = 0; k < t.na; ++k) prefetch_key(t.ka[k], t.va[k], ND * kLanes * int64_t(sizeof(R)));
}

// 16-lane fp32: few rows (decodes) by dot products, many (prefill) against the
// transposed tile; P V two rows per pass.
struct AttnF32x16 {
  using Row = float;
  template <int ND, typename T>
  static void stage_queries(const T* q, int64_t ntok, int64_t G, int64_t stride, float scale,
                            AttnScratch& w) {
    stage_queries_f32<ND>(q, ntok, G, stride, scale, w);
  }
  template <int ND, typename R>
  static void scores(AttnScratch& w, float, int rows, const TileRows<R>& t, int nk) {
    prefetch_ahead<ND>(t);
    if (rows < 8)
      scores_by_dot<ND>(w.q.data(), rows, t.k, nk, w.kt.data(), w.s.data());
    else
      scores_by_tile<ND>(w.q.data(), rows, t.k, nk, w.kt.data(), w.s.data());
  }
  template <int ND, typename R>
  static void stage_values(const R* const* vrows, int nk, AttnScratch& w) {
    stage_values_f32<ND>(vrows, nk, w);
  }
  template <int ND, typename R>
  static bool whole_tile(AttnScratch&, float, int, int64_t, int64_t, int, int64_t,
                         const TileRows<R>&) {
    return false;
  }
  template <int ND>
  static void accumulate(AttnScratch& w, int rows, const float* corr, int nk) {
    accumulate_rows<ND>(w, rows, 0, corr, nk);
  }
};

#if !defined(__AVX512F__)
// 8-lane fp32: scores four keys at a time, P V a row at a time.
struct AttnF32x8 {
  using Row = float;
  template <int ND, typename T>
  static void stage_queries(const T* q, int64_t ntok, int64_t G, int64_t stride, float scale,
                            AttnScratch& w) {
    stage_queries_f32<ND>(q, ntok, G, stride, scale, w);
  }
  template <int ND, typename R>
  static void scores(AttnScratch& w, float, int rows, const TileRows<R>& t, int nk) {
    prefetch_ahead<ND>(t);
    scores_avx2<ND>(w.q.data(), rows, t.k, nk, w.kt.data(), w.s.data());
  }
  template <int ND, typename R>
  static void stage_values(const R* const* vrows, int nk, AttnScratch& w) {
    stage_values_f32<ND>(vrows, nk, w);
  }
  template <int ND, typename R>
  static bool whole_tile(AttnScratch&, float, int, int64_t, int64_t, int, int64_t,
                         const TileRows<R>&) {
    return false;
  }
  template <int ND>
  static void accumulate(AttnScratch& w, int rows, const float* corr, int nk) {
    constexpr int D = ND * kLanes;
    for (int r = 0; r < rows; ++r)
      accumulate_avx2<ND>(w.o.data() + r * D, w.s.data() + r * kKeyTile, corr[r], w.v.data(),
                          nk);
  }
};
#endif

#if defined(__AVX512BF16__)
// bf16 pairs: unscaled bf16 queries against bf16 key rows (the scale applied to the
// scores), P rounded to bf16 against V by key pairs.
struct AttnBf16Dot {
  using Row = c10::BFloat16;
  template <int ND>
  static void stage_queries(const c10::BFloat16* q, int64_t ntok, int64_t G, int64_t stride,
                            float, AttnScratch& w) {
    constexpr int D = ND * kLanes;
    for (int64_t t = 0; t < ntok; ++t)
      std::memcpy(w.qb.data() + t * G * D, q + t * stride, G * D * sizeof(c10::BFloat16));
  }
  template <int ND>
  static void scores(AttnScratch& w, float scale, int rows, const TileRows<Row>& t, int nk) {
    if (rows < 8) {  // the prefetches spread over the dot products
      scores_by_dot_bf16<ND>(w.qb.data(), scale, rows, t.k, nk, w.s.data(), t.ka, t.va, t.na);
      return;
    }
    prefetch_ahead<ND>(t);  // many rows: a tile's arithmetic dwarfs its prefetches
    scores_by_tile_bf16<ND>(w.qb.data(), scale, rows, t.k, nk, w.kt.data(), w.s.data());
  }
  template <int ND>
  static void stage_values(const Row* const* vrows, int nk, AttnScratch& w) {
    // (kKeyTile even: the pairs never straddle tiles)
    pair_values<ND>(vrows, nk, reinterpret_cast<uint32_t*>(w.v.data()));
  }
  // Items of 8 rows or more on the matrix unit, where the thread's tiles are set up
  // (attention_amx.h): the whole tile, scores to P V, there.
  template <int ND>
  static bool whole_tile(AttnScratch& w, float scale, int rows, int64_t G, int64_t rel, int nk,
                         int64_t window, const TileRows<Row>& t) {
#if defined(TW_ATTN_AMX)
    if (w.amx && rows >= 8) {
      prefetch_ahead<ND>(t);
      stage_values<ND>(t.v, nk, w);
      tile_amx<ND>(w, scale, rows, G, rel, nk, window, t.k);
      return true;
    }
#endif
    (void)w, (void)scale, (void)rows, (void)G, (void)rel, (void)nk, (void)window, (void)t;
    return false;
  }
  template <int ND>
  static void accumulate(AttnScratch& w, int rows, const float* corr, int nk) {
    accumulate_rows_bf16<ND>(w, rows, corr, nk);
  }
};
#endif

// The primitive set of this build for activations T and head_dim ND * 16: the one place
// the attention's ISA is chosen.
#if defined(__AVX512BF16__)
template <int ND, typename T>
using AttnIsa = std::conditional_t<std::is_same_v<T, c10::BFloat16> && ND % 2 == 0, AttnBf16Dot,
                                   AttnF32x16>;
#elif defined(__AVX512F__)
template <int ND, typename T>
using AttnIsa = AttnF32x16;
#else
template <int ND, typename T>
using AttnIsa = AttnF32x8;
#endif

}  // namespace tw
