// x W^T for batches of rows (5 to hundreds) with W in a GGUF block type (Q4_K, Q5_K,
// Q6_K, Q8_0, Q4_0, Q4_1) and x quantized to int8, on AVX-512 VNNI: a GEMM on the integer
// units. vpdpbusd multiplies 64 byte pairs an instruction where vdpbf16ps multiplies 32
// bf16 pairs, at the same rate (a Zen 4 core: 230 against 117 G multiply-adds a second,
// measured with independent accumulators in registers).
//
// The bf16 tiled kernel (gguf_quant.h qlinear_tiled) turns every weight into bf16 once a
// call and multiplies at bf16's rate; here a weight's 4-8 bit code is only widened to a
// byte. Per call, 32 weight rows (a panel, two vectors of 16 output columns) are laid out
// one 256-value K block at a time: the codes as [K quad][column][4] bytes (vpdpbusd's
// unsigned operand; the stored nibbles transposed 16 x 16 in 32-bit groups, then
// split), the factors a column a lane. For a K quad and a row of x, its four int8 values
// broadcast from memory by the instruction itself:
//     I[col] += c0 x0 + c1 x1 + c2 x2 + c3 x3
// in 32-bit lanes, 16 columns a vector, no horizontal sums. Each sub-block's I then
// takes its scale: K types in integers (vpmulld by the 6-8 bit scale into the block's
// sum), the 32-value types in fp32 (their fp16 d). Every row of x meets the laid-out
// block while it is in L1. Per block and row, in fp32:
//     K types:  y += dx * (d S - e J),   S = sum over sub-blocks of sc I,
//               J = sum over sub-blocks of t[col, s] X[row, s]
// where X is the row's sum of x_q over the sub-block and (t, e) the offsets:
// Q4_K/Q5_K w = d sc q - dmin m: t = m, e = dmin; Q6_K w = d sc (q - 32): t = sc, e = 32 d
// (J in integers, a vpdpwssd per two sub-blocks: X as word pairs, broadcast).
//     Q8_0, Q4_0, Q4_1 (w = d q + o):  y += sum over blocks of dx (d I + o X)
// with Q8_0's signed codes read as unsigned (q + 128, o = -128 d), Q4_0's o = -8 d,
// Q4_1's o = m.
//
// x is quantized as the small-batch kernel quantizes it for the K types (XQ: per 256
// values of a row, dx = max|x| / 127); for the 32-value types (and int8 rows) per 32
// values, each block's dx applied with its d (llama.cpp's Q8_0 activations; the small
// kernel takes 64).
#pragma once

#include <memory>

#include "gguf_quant.h"

namespace tw {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

// Whether qlinear_int8 multiplies weights of type t with rows of `in` values.
inline bool qgemm_int8_reads(QType t, int64_t in) {
  return qtype_known(int64_t(t)) && in % 256 == 0;
}

// How a type's block meets the products: K (Q4_K, Q5_K: 8 sub-blocks of 32 with integer
// scales and offsets), K6 (Q6_K: 16 of 16), B32 (Q8_0, Q4_0, Q4_1: 8 blocks of 32 in 256
// values, each with fp16 factors: w = d q + o, o = -128 d, -8 d or m).
enum class Kind { K, K6, B32 };

inline Kind kind_of(QType t) {
  return t == QType::Q6_K ? Kind::K6
         : t == QType::Q4_K || t == QType::Q5_K ? Kind::K : Kind::B32;
}

// One K block of a 32-row panel laid out for the products (v: which 16 columns).
struct alignas(64) PanelBlock {
  __m512i codes[64][2];   // K quad q: 16 columns x 4 codes
  __m512i scales[16][2];  // sub-block s: each column's scale
  __m512i offs[8][2];     // sub-block pair p: each column's (t[2p], t[2p + 1]) as words
  __m512 d[2], e[2];      // each column's d and e (zero past the matrix)
  __m512 bd[8][2], bo[8][2];  // B32: block s's d and offset factor o a column
};

inline int32_t word_pair(int lo, int hi) {
  return int32_t(uint32_t(uint16_t(int16_t(lo))) | (uint32_t(uint16_t(int16_t(hi))) << 16));
}

// 32-bit words at `base` + 16 row offsets (`rows`), those of rows past n zero.
inline __m512i gather_rows(const uint8_t* base, __m512i rows, __mmask16 n) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), n, rows, base, 1);
}

// Byte k (0-3) of each 32-bit lane, unsigned.
inline __m512i byte_of(__m512i v, int k) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
}

// Each lane's low (hi false) or high 16 bits, fp16, as fp32.
inline __m512 half_lanes(__m512i v, bool hi) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

// lay_out_block for the 32-value types: 8 of their blocks make a 256-value block b.
inline void lay_out_b32(QType t, const uint8_t* w, int64_t row_bytes, int n, int64_t b,
                        PanelBlock& pb, int v, __mmask16 live, __m512i rows) {
  const int64_t bytes = t == QType::Q8_0 ? 34 : t == QType::Q4_0 ? 18 : 20;
  const uint8_t* w0 = w + b * 8 * bytes;
  for (int s = 0; s < 8; ++s) {  // fp16 d (and Q4_1's m) at the start of each block
    const __m512i dm = gather_rows(w0 + s * bytes, rows, live);
    const __m512 d = half_lanes(dm, false);
    pb.bd[s][v] = d;
    pb.bo[s][v] = t == QType::Q4_1 ? half_lanes(dm, true)
                  : _mm512_mul_ps(d, _mm512_set1_ps(t == QType::Q8_0 ? -128.0f : -8.0f));
  }
  if (t == QType::Q8_0) {  // signed codes as unsigned (+128: o = -128 d), 64 a vector
    __m512i codes[4][16];
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < 4; ++c) {
        const uint8_t* p = w0 + j * row_bytes + 2 * c * bytes + 2;
        codes[c][j] = j < n ? _mm512_xor_si512(_mm512_inserti64x4(
                                  _mm512_castsi256_si512(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(p))),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bytes)), 1),
                                  flip)
                            : _mm512_setzero_si512();
      }
    for (int c = 0; c < 4; ++c) {
      transpose16x16(codes[c]);
      for (int i = 0; i < 16; ++i) pb.codes[16 * c + i][v] = codes[c][i];
    }
    return;
  }
  // Q4_0/Q4_1: each block's 16 bytes of nibbles (value i low in byte i, 16 + i high), 4
  // blocks a vector, transposed as stored: word d of vector z holds block B = 4 z + d / 4's
  // quads 8 B + d % 4 (low nibbles) and 8 B + 4 + d % 4 (high)
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int z = 0; z < 2; ++z) {
    __m512i q[16];
    for (int j = 0; j < 16; ++j) {
      q[j] = _mm512_setzero_si512();
      if (j >= n) continue;
      const uint8_t* p = w0 + j * row_bytes + 4 * z * bytes + (bytes - 16);
      for (int k = 0; k < 4; ++k)
        q[j] = _mm512_inserti32x4(q[j], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * bytes)), k);
    }
    transpose16x16(q);
    for (int d = 0; d < 16; ++d) {
      const int blk = 4 * z + d / 4;
      pb.codes[8 * blk + d % 4][v] = _mm512_and_si512(q[d], low);
      pb.codes[8 * blk + 4 + d % 4][v] = _mm512_and_si512(_mm512_srli_epi32(q[d], 4), low);
    }
  }
}

// Block b of columns [0, n) (n <= 16) of the rows from w (row_bytes apart) into half v of
// pb. The scales of the 16 columns are read side by side (gathered 32-bit words, a
// column a lane); the codes a column at a time, then transposed.
inline void lay_out_block(QType t, const uint8_t* w, int64_t row_bytes, int n, int64_t b,
                          PanelBlock& pb, int v) {
  const __mmask16 live = __mmask16((1u << n) - 1);
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(int32_t(row_bytes)));
  if (kind_of(t) == Kind::B32) return lay_out_b32(t, w, row_bytes, n, b, pb, v, live, rows);
  const bool q6 = t == QType::Q6_K, five = t == QType::Q5_K;
  const int64_t bytes = q6 ? 210 : five ? 176 : 144;
  const uint8_t* w0 = w + b * bytes;
  if (q6) {
    // 16 int8 scales at 192, fp16 d at 208 (read as the high half of the word at 206, so
    // the last block's gather stays inside it)
    __m512i g[4];
    for (int k = 0; k < 4; ++k) g[k] = gather_rows(w0 + 192 + 4 * k, rows, live);
    const __m512 d = half_lanes(gather_rows(w0 + 206, rows, live), true);
    for (int k = 0; k < 16; ++k)  // sign-extended byte k % 4 of g[k / 4]
      pb.scales[k][v] = _mm512_srai_epi32(_mm512_slli_epi32(g[k / 4], 24 - 8 * (k % 4)), 24);
    pb.d[v] = d;
    for (int p = 0; p < 8; ++p) {  // bytes 2p, 2p + 1 as words
      const __m512i two = p % 2 ? _mm512_srli_epi32(g[p / 2], 16) : g[p / 2];
      pb.offs[p][v] = _mm512_cvtepi8_epi16(_mm512_cvtepi32_epi16(two));
    }
    pb.e[v] = _mm512_mul_ps(d, _mm512_set1_ps(32.0f));
  } else {
    // fp16 d and dmin, then 12 bytes of six-bit scales and mins (k4_scale_min)
    const __m512i dm = gather_rows(w0, rows, live);
    const __m512i s0 = gather_rows(w0 + 4, rows, live), s1 = gather_rows(w0 + 8, rows, live),
                  s2 = gather_rows(w0 + 12, rows, live);
    pb.d[v] = half_lanes(dm, false);
    pb.e[v] = half_lanes(dm, true);
    const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
    __m512i mins[8];
    for (int k = 0; k < 8; ++k) {
      __m512i sc, mn;
      if (k < 4) {
        sc = _mm512_and_si512(byte_of(s0, k), low6);
        mn = _mm512_and_si512(byte_of(s1, k), low6);
      } else {
        const __m512i hi = byte_of(s2, k - 4);
        sc = _mm512_or_si512(_mm512_and_si512(hi, low4),
                             _mm512_slli_epi32(_mm512_srli_epi32(byte_of(s0, k - 4), 6), 4));
        mn = _mm512_or_si512(_mm512_srli_epi32(hi, 4),
                             _mm512_slli_epi32(_mm512_srli_epi32(byte_of(s1, k - 4), 6), 4));
      }
      pb.scales[k][v] = sc;
      mins[k] = mn;
    }
    for (int p = 0; p < 4; ++p)
      pb.offs[p][v] = _mm512_or_si512(mins[2 * p], _mm512_slli_epi32(mins[2 * p + 1], 16));
  }
  if (q6) {
    // 128 bytes of low nibbles (ql) and 64 of high pairs (qh) transposed as they are
    // (32-bit word d of each column side by side): K quad k of half h = k / 32 and
    // quarter r = k % 32 / 8 takes the low (r < 2) or high nibbles of ql word
    // 16 h + 8 (r % 2) + k % 8 and bits 2 r, 2 r + 1 of qh word 8 h + k % 8.
    __m512i ql[2][16], qh[16];
    for (int j = 0; j < 16; ++j) {
      const uint8_t* blk = w0 + j * row_bytes;
      for (int z = 0; z < 2; ++z) ql[z][j] = j < n ? _mm512_loadu_si512(blk + 64 * z) : _mm512_setzero_si512();
      qh[j] = j < n ? _mm512_loadu_si512(blk + 128) : _mm512_setzero_si512();
    }
    transpose16x16(ql[0]);
    transpose16x16(ql[1]);
    transpose16x16(qh);
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int k = 0; k < 64; ++k) {
      const int h = k / 32, r = k % 32 / 8, p = k % 8;
      const __m512i l = ql[h][8 * (r % 2) + p];
      const __m512i nib = _mm512_and_si512(r < 2 ? l : _mm512_srli_epi32(l, 4), low);
      const __m512i hq = qh[8 * h + p];
      const __m512i pair = r == 0 ? _mm512_slli_epi32(hq, 4) : r == 1 ? _mm512_slli_epi32(hq, 2)
                           : r == 2 ? hq : _mm512_srli_epi32(hq, 2);
      pb.codes[k][v] = _mm512_ternarylogic_epi32(nib, pair, top, 0xF8);  // nib | (pair & top)
    }
    return;
  }
  // Q4_K/Q5_K: the 128 bytes of nibbles transposed as they are (half the shuffles of
  // transposing the codes): 32-bit word i of 64 bytes z holds the low nibbles of K quad
  // 16 (2 z + i / 8) + i % 8 and the high nibbles of the quad 8 after it. Q5_K's fifth
  // bits (qh: value l's in byte l % 32, bit l / 32) transposed likewise: word p of qh
  // holds quad k's at bit k / 8 of each byte, k % 8 = p.
  const int64_t qs_at = five ? 48 : 16;
  __m512i qh[16];
  if (five) {
    for (int j = 0; j < 16; ++j)
      qh[j] = j < n ? _mm512_zextsi256_si512(_mm256_loadu_si256(
                          reinterpret_cast<const __m256i*>(w0 + j * row_bytes + 16)))
                    : _mm512_setzero_si512();
    transpose16x16(qh);
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int z = 0; z < 2; ++z) {
    __m512i q[16];
    for (int j = 0; j < 16; ++j)
      q[j] = j < n ? _mm512_loadu_si512(w0 + j * row_bytes + qs_at + 64 * z) : _mm512_setzero_si512();
    transpose16x16(q);
    for (int i = 0; i < 16; ++i) {
      const int k = 16 * (2 * z + i / 8) + i % 8;
      __m512i lo = _mm512_and_si512(q[i], low), hi = _mm512_and_si512(_mm512_srli_epi32(q[i], 4), low);
      if (five) {
        const __m512i one = _mm512_set1_epi8(1);
        const __m512i h = qh[k % 8];
        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, k / 8), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, (k + 8) / 8), one), 4));
      }
      pb.codes[k][v] = lo;
      pb.codes[k + 8][v] = hi;
    }
  }
}

// x quantized for qlinear_int8: XQ's bytes and scales, and each row's sums of x_q over
// each sub-block (32 values; Q6_K 16) as word pairs, [rows, in / (2 * sub)].
struct XQPairs {
  XQ xq;
  std::vector<int32_t> pairs;
  std::vector<float> sums;  // the same sums as fp32, [rows, in / sub]
  int64_t per_block = 0;  // pairs a 256-value block
  // group: the values of a row that share a scale (256; the 32-value types 32)
  void fill(const float* xf, int rows, int64_t in, int sub, int64_t group = 256) {
    xq.fill(xf, rows, in, group);
    per_block = 256 / (2 * sub);
    pairs.resize(rows * (in / (2 * sub)));
    sums.resize(rows * (in / sub));
    at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const int8_t* q = xq.row(int(m));
        for (int64_t p = 0; p < in / (2 * sub); ++p) {
          int s[2] = {0, 0};
          for (int h = 0; h < 2; ++h)
            for (int i = 0; i < sub; ++i) s[h] += q[(2 * p + h) * sub + i];
          pairs[m * (in / (2 * sub)) + p] = word_pair(s[0], s[1]);
          sums[m * (in / sub) + 2 * p] = float(s[0]);
          sums[m * (in / sub) + 2 * p + 1] = float(s[1]);
        }
      }
    });
  }
};

// acc += the byte products of w (unsigned) with the four bytes at x (signed) broadcast,
// in 32-bit lanes: vpdpbusd with its broadcast memory operand (written out: compilers
// load the broadcast into a register first when two products share it, one more vector
// operation each, which costs the loop a fifth of its speed on a Zen 4).
inline void dpbusd_bcast(__m512i& acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

// R rows of x (m0 ..) against one laid-out block b: acc [R][32] += their share of y.
template <int R, Kind KD>
inline void block_rows(const PanelBlock& pb, const XQPairs& x, int m0, int64_t b, float* acc) {
  constexpr int kQuads = KD == Kind::K6 ? 4 : 8;  // K quads a sub-block
  const int64_t in = x.xq.in, nb = in / 256;
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r)
    xr[r] = reinterpret_cast<const int32_t*>(x.xq.row(m0 + r) + b * 256);
  // K, K6: the block's sum over sub-blocks of sc times their integer sums; B32: the fp32
  // sum of d I + o X over its 8 blocks
  __m512i ig[R][2];
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) {
    ig[r][0] = ig[r][1] = _mm512_setzero_si512();
    f[r][0] = f[r][1] = _mm512_setzero_ps();
  }
  for (int s = 0; s < 64 / kQuads; ++s) {
    __m512i ia[R][2];
    for (int r = 0; r < R; ++r) ia[r][0] = ia[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int kk = 0; kk < kQuads; ++kk) {
      const int k = s * kQuads + kk;
      const __m512i w0 = pb.codes[k][0], w1 = pb.codes[k][1];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        dpbusd_bcast(ia[r][0], w0, xr[r] + k);
        dpbusd_bcast(ia[r][1], w1, xr[r] + k);
      }
    }
    if constexpr (KD == Kind::B32) {  // x has a scale a 32-value block too: dx (d I + o X)
      const int64_t at = b * 8 + s;
      for (int r = 0; r < R; ++r) {
        const __m512 xsum = _mm512_set1_ps(x.sums[(m0 + r) * (in / 32) + at]);
        const __m512 dx = _mm512_set1_ps(x.xq.dx[(m0 + r) * (in / 32) + at]);
        for (int v = 0; v < 2; ++v)
          f[r][v] = _mm512_fmadd_ps(
              _mm512_fmadd_ps(pb.bo[s][v], xsum, _mm512_mul_ps(_mm512_cvtepi32_ps(ia[r][v]), pb.bd[s][v])),
              dx, f[r][v]);
      }
    } else {
      // the sub-block's scale in integers (vpmulld: on a Zen 4 faster here than a
      // conversion and an fp32 multiply-add a sub-block)
      const __m512i c0 = pb.scales[s][0], c1 = pb.scales[s][1];
      for (int r = 0; r < R; ++r) {
        ig[r][0] = _mm512_add_epi32(ig[r][0], _mm512_mullo_epi32(ia[r][0], c0));
        ig[r][1] = _mm512_add_epi32(ig[r][1], _mm512_mullo_epi32(ia[r][1], c1));
      }
    }
  }
  const int pairs = int(x.per_block);
  for (int r = 0; r < R; ++r) {
    const int32_t* xp = x.pairs.data() + (m0 + r) * (nb * pairs) + b * pairs;
    for (int v = 0; v < 2; ++v) {
      float* a = acc + r * 32 + 16 * v;
      if constexpr (KD == Kind::B32) {  // (dx applied a 32-value block)
        _mm512_storeu_ps(a, _mm512_add_ps(f[r][v], _mm512_loadu_ps(a)));
        continue;
      }
      const __m512 dx = _mm512_set1_ps(x.xq.dx[(m0 + r) * nb + b]);
      __m512i j = _mm512_setzero_si512();
      for (int p = 0; p < pairs; ++p)
        j = _mm512_dpwssd_epi32(j, pb.offs[p][v], _mm512_set1_epi32(xp[p]));
      const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(ig[r][v]), pb.d[v],
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(j), pb.e[v]));
      _mm512_storeu_ps(a, _mm512_fmadd_ps(t, dx, _mm512_loadu_ps(a)));
    }
  }
}

// Every row of x against laid-out block b, kR rows at a time (acc [rows][32]).
template <int kR, Kind KD>
inline void rows_of_block(const PanelBlock& pb, const XQPairs& x, int64_t rows, int64_t b,
                          float* acc) {
  int64_t m = 0;
  for (; m + kR <= rows; m += kR) block_rows<kR, KD>(pb, x, int(m), b, acc + m * 32);
  float* a = acc + m * 32;
  switch (rows - m) {
#define TW_TAIL(R)                                  \
  case R:                                           \
    return block_rows<R, KD>(pb, x, int(m), b, a);
    TW_TAIL(1) TW_TAIL(2) TW_TAIL(3) TW_TAIL(4) TW_TAIL(5) TW_TAIL(6) TW_TAIL(7)
#undef TW_TAIL
    default: return;
  }
}

// The GEMM over panels of 32 weight rows: `lay(pb, n0, n, b)` lays out block b of the rows
// [n0, n0 + n) into pb; w, row_bytes: the weight's bytes, for prefetching the next panel.
template <class Lay>
inline void qgemm_panels(c10::BFloat16* y, int64_t y_stride, const XQPairs& x, int64_t rows,
                         Kind kd, const uint8_t* w, int64_t row_bytes, int64_t out,
                         const c10::BFloat16* bias, const Lay& lay) {
  constexpr int kPanel = 32, kR = 6;
  const int64_t nb = x.xq.in / 256, panels = (out + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    auto pb = std::make_unique<PanelBlock>();
    std::vector<float> acc(rows * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      const int n = int(std::min<int64_t>(kPanel, out - n0));
      std::fill(acc.begin(), acc.end(), 0.0f);
      // the next panel (its rows are contiguous) into L2 a part a block: read block by
      // block, 32 rows apart, it is too many short streams for the hardware prefetcher
      const int64_t next = p + 1 < p1 ? std::min<int64_t>(kPanel, out - n0 - kPanel) * row_bytes : 0;
      const uint8_t* nw = w + (n0 + kPanel) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t o = next * b / nb; o < next * (b + 1) / nb; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(nw + o), _MM_HINT_T1);
        lay(*pb, n0, n, b);
        if (kd == Kind::K6)
          rows_of_block<kR, Kind::K6>(*pb, x, rows, b, acc.data());
        else if (kd == Kind::K)
          rows_of_block<kR, Kind::K>(*pb, x, rows, b, acc.data());
        else
          rows_of_block<kR, Kind::B32>(*pb, x, rows, b, acc.data());
      }
      __m512 bv[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      if (bias) {
        alignas(64) float bb[kPanel] = {};
        for (int j = 0; j < n; ++j) bb[j] = float(bias[n0 + j]);
        bv[0] = _mm512_load_ps(bb);
        bv[1] = _mm512_load_ps(bb + 16);
      }
      const __mmask32 keep = n == 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1);
      for (int64_t r = 0; r < rows; ++r) {
        const float* a = acc.data() + r * kPanel;
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(a), bv[0]);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(a + 16), bv[1]);
        _mm512_mask_storeu_epi16(y + r * y_stride + n0, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  });
}

// y [rows, out] (row stride y_stride) = x W^T (+ bias) for bf16 x with any number of rows,
// W [out rows of row_bytes] of a type qgemm_int8_reads takes; xf: x in fp32.
inline void qlinear_int8(c10::BFloat16* y, int64_t y_stride, const float* xf, int64_t rows,
                         QType t, const uint8_t* w, int64_t row_bytes, int64_t in, int64_t out,
                         const c10::BFloat16* bias) {
  const Kind kd = kind_of(t);
  XQPairs x;
  x.fill(xf, int(rows), in, kd == Kind::K6 ? 16 : 32, kd == Kind::B32 ? 32 : 256);
  qgemm_panels(y, y_stride, x, rows, kd, w, row_bytes, out, bias,
               [&](PanelBlock& pb, int64_t n0, int n, int64_t b) {
                 for (int v = 0; v < 2; ++v)
                   lay_out_block(t, w + (n0 + 16 * v) * row_bytes, row_bytes,
                                 std::max(0, std::min(16, n - 16 * v)), b, pb, v);
               });
}

// Block b (256 values) of 16 rows of int8 weights with a scale each (`--quantization
// int8`: w = s q), rows [0, n) of those from q (`in` apart), into half v of pb: as Q8_0's
// codes (q + 128, o = -128 s), every 32-value group with the row's scale.
inline void lay_out_int8_rows(const int8_t* q, int64_t in, const float* scale, int n,
                              int64_t b, PanelBlock& pb, int v) {
  const __mmask16 live = __mmask16((1u << n) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(live, scale);
  const __m512 o = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
  for (int g = 0; g < 8; ++g) {
    pb.bd[g][v] = s;
    pb.bo[g][v] = o;
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i codes[4][16];
  for (int j = 0; j < 16; ++j)
    for (int c = 0; c < 4; ++c)
      codes[c][j] = j < n ? _mm512_xor_si512(_mm512_loadu_si512(q + j * in + b * 256 + 64 * c), flip)
                          : _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    transpose16x16(codes[c]);
    for (int i = 0; i < 16; ++i) pb.codes[16 * c + i][v] = codes[c][i];
  }
}

// y = x (q s)^T (+ bias) for bf16 x with any number of rows and int8 weights q [out, in]
// with a scale a row (in a multiple of 256); xf: x in fp32.
inline void linear_int8_rows(c10::BFloat16* y, int64_t y_stride, const float* xf, int64_t rows,
                             const int8_t* q, const float* scale, int64_t in, int64_t out,
                             const c10::BFloat16* bias) {
  XQPairs x;
  x.fill(xf, int(rows), in, 32, 32);
  qgemm_panels(y, y_stride, x, rows, Kind::B32, reinterpret_cast<const uint8_t*>(q), in, out,
               bias, [&](PanelBlock& pb, int64_t n0, int n, int64_t b) {
                 for (int v = 0; v < 2; ++v)
                   lay_out_int8_rows(q + (n0 + 16 * v) * in, in, scale + n0 + 16 * v,
                                     std::max(0, std::min(16, n - 16 * v)), b, pb, v);
               });
}

#else

inline bool qgemm_int8_reads(QType, int64_t) { return false; }

// (never called: qgemm_int8_reads says no)
inline void qlinear_int8(c10::BFloat16*, int64_t, const float*, int64_t, QType, const uint8_t*,
                         int64_t, int64_t, int64_t, const c10::BFloat16*) {}
inline void linear_int8_rows(c10::BFloat16*, int64_t, const float*, int64_t, const int8_t*,
                             const float*, int64_t, int64_t, const c10::BFloat16*) {}

#endif

}  // namespace tw
