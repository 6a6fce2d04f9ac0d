// The register tiles of the float32 block kernels (qgemv.cpp): blocks dequantized in SIMD
// registers, AVX-512, AVX2 or scalar by what the compiler targets, never written to memory.
//
// Tiles: MR rows of x by NR rows of W; each block is dequantized once per tile and used MR
// times. Threads take chunks of output rows (chunks.h); x stays in cache, each thread
// streams its own weight rows once per MR-row chunk of x (once in all at decode).
#pragma once

#include <ATen/Parallel.h>

#include "blocks.h"
#include "chunks.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tessera {
namespace tiles {

// Scalar reference order of one block (also the fallback where no AVX is compiled in).
template <typename W>
inline void dequant_block_scalar(const W& w, int64_t n, int64_t b, float d, float m, float* out) {
  if constexpr (W::kQ8) {
    const int8_t* p = w.block(n, b);
    for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(p[j]);
  } else {
    const uint8_t* p = w.block(n, b);
    for (int j = 0; j < 16; ++j) {
      out[j] = std::fma(static_cast<float>(p[j] & 0x0F), d, m);
      out[j + 16] = std::fma(static_cast<float>(p[j] >> 4), d, m);
    }
  }
}

#if defined(__AVX512F__)
// Q4 through a table: lut = d * [0..15] + m (one fma per group), then each weight is
// lut[q]: vpermps reads only the low 4 bits of each index lane, so the zero-extended bytes
// index the low nibbles as they are and, shifted right by 4, the high nibbles.
template <typename W>
inline __m512 group_lut(const W&, float d, float m) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
}

// One block as two 16-float vectors; `v` is the group's table (Q4) or broadcast scale (Q8).
template <typename W>
inline void dequant_block(const W& w, int64_t n, int64_t b, __m512 v, __m512& w0, __m512& w1) {
  if constexpr (W::kQ8) {
    const int8_t* p = w.block(n, b);
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), v);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), v);
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.block(n, b))));
    w0 = _mm512_permutexvar_ps(bytes, v);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), v);
  }
}

template <typename W, int MR, int NR>
void tile(const W& w, const float* x, int64_t ldx, int64_t n0, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t nb = w.K / kBlock;
  for (int64_t g = 0, b = 0; b < nb; ++g) {
    __m512 v[NR];
    for (int r = 0; r < NR; ++r) {
      if constexpr (W::kQ8) {
        v[r] = _mm512_set1_ps(w.scale(n0 + r, g));
      } else {
        v[r] = group_lut(w, w.scale(n0 + r, g), w.offset(n0 + r, g));
      }
    }
    const int64_t end = std::min(nb, b + w.blocks_per_group);
    for (; b < end; ++b) {
      __m512 w0[NR], w1[NR];
      for (int r = 0; r < NR; ++r) dequant_block(w, n0 + r, b, v[r], w0[r], w1[r]);
      for (int i = 0; i < MR; ++i) {
        const __m512 x0 = _mm512_loadu_ps(x + i * ldx + b * kBlock);
        const __m512 x1 = _mm512_loadu_ps(x + i * ldx + b * kBlock + 16);
        for (int r = 0; r < NR; ++r) {
          acc[i][r] = _mm512_fmadd_ps(w0[r], x0, acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(w1[r], x1, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + n0 + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block as four 8-float vectors.
template <typename W>
inline void dequant_block(const W& w, int64_t n, int64_t b, __m256 d, __m256 m, __m256* out) {
  if constexpr (W::kQ8) {
    const int8_t* p = w.block(n, b);
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * k));
      out[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.block(n, b)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k)
      out[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k])), d, m);
  }
}

template <typename W, int MR, int NR>
void tile(const W& w, const float* x, int64_t ldx, int64_t n0, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t nb = w.K / kBlock;
  for (int64_t g = 0, b = 0; b < nb; ++g) {
    float d[NR], m[NR];
    for (int r = 0; r < NR; ++r) {
      d[r] = w.scale(n0 + r, g);
      m[r] = w.offset(n0 + r, g);
    }
    const int64_t end = std::min(nb, b + w.blocks_per_group);
    for (; b < end; ++b) {
      __m256 wv[NR][4];
      for (int r = 0; r < NR; ++r)
        dequant_block(w, n0 + r, b, _mm256_set1_ps(d[r]), _mm256_set1_ps(m[r]), wv[r]);
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * ldx + b * kBlock;
        for (int k = 0; k < 4; ++k) {
          const __m256 xv = _mm256_loadu_ps(xb + 8 * k);
          for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_fmadd_ps(wv[r][k], xv, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + n0 + r] = hsum256(acc[i][r]);
}
#else
template <typename W, int MR, int NR>
void tile(const W& w, const float* x, int64_t ldx, int64_t n0, float* y, int64_t ldy) {
  float acc[MR][NR] = {};
  float wb[kBlock];
  const int64_t nb = w.K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / w.blocks_per_group;
    for (int r = 0; r < NR; ++r) {
      dequant_block_scalar(w, n0 + r, b, w.scale(n0 + r, g), w.offset(n0 + r, g), wb);
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * ldx + b * kBlock;
        float s = 0.0f;
        for (int j = 0; j < kBlock; ++j) s += wb[j] * xb[j];
        acc[i][r] += s;
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + n0 + r] = acc[i][r];
}
#endif

// Rows [n_begin, n_end) of W against MR rows of x, NR weight rows at a time.
template <typename W, int MR, int NR>
void rows_tile(const W& w, const float* x, int64_t ldx, int64_t n_begin, int64_t n_end,
               float* y, int64_t ldy) {
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) tile<W, MR, NR>(w, x, ldx, n, y, ldy);
  for (; n < n_end; ++n) tile<W, MR, 1>(w, x, ldx, n, y, ldy);
}

// Weight rows per task a thread takes (chunks.h): a multiple of every tile's NR.
constexpr int64_t kTaskRows = 32;

template <typename W>
void gemm(const W& w, const float* x, int64_t M, int64_t N, float* y) {
  const int64_t K = w.K;
  // ~64 KiB of 4-bit weights per task at least: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(K, 1));
  parallel_chunks(N, kTaskRows, grain, [&](int64_t begin, int64_t end) {
    // Weight rows outer (in chunks that stay in L1/L2), x-row chunks inner.
    constexpr int64_t kRowChunk = 16;
    for (int64_t n0 = begin; n0 < end; n0 += kRowChunk) {
      const int64_t n1 = std::min(end, n0 + kRowChunk);
      int64_t i = 0;
      for (; i + 8 <= M; i += 8) rows_tile<W, 8, 2>(w, x + i * K, K, n0, n1, y + i * N, N);
      if (M - i >= 4) { rows_tile<W, 4, 2>(w, x + i * K, K, n0, n1, y + i * N, N); i += 4; }
      if (M - i >= 2) { rows_tile<W, 2, 4>(w, x + i * K, K, n0, n1, y + i * N, N); i += 2; }
      if (M - i >= 1) { rows_tile<W, 1, 4>(w, x + i * K, K, n0, n1, y + i * N, N); i += 1; }
    }
  });
}

// Row n of W as float32 into dst[K].
template <typename W>
inline void dequantize_row(const W& w, int64_t n, float* dst) {
  const int64_t nb = w.K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / w.blocks_per_group;
#if defined(__AVX512F__)
    const __m512 v = W::kQ8 ? _mm512_set1_ps(w.scale(n, g))
                            : group_lut(w, w.scale(n, g), w.offset(n, g));
    __m512 w0, w1;
    dequant_block(w, n, b, v, w0, w1);
    _mm512_storeu_ps(dst + b * kBlock, w0);
    _mm512_storeu_ps(dst + b * kBlock + 16, w1);
#else
    dequant_block_scalar(w, n, b, w.scale(n, g), w.offset(n, g), dst + b * kBlock);
#endif
  }
}

template <typename W>
void dequantize_rows(const W& w, int64_t N, float* out) {
  const int64_t K = w.K;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(w, n, out + n * K);
  });
}

}  // namespace tiles
}  // namespace tessera
