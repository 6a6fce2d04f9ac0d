// Linear layers over 4-bit and 8-bit weight blocks read as stored: y[M, N] = x[M, K] @ W^T,
// W dequantized in registers, one 32-weight block at a time, never written to memory.
//
// Layout (kernels/qgemv.py documents it for every reader, GPU kernels included):
//   Q4: qs uint8 [N, K/2]: row n is K/32 blocks of 16 bytes; in block b, byte j holds the
//       code (0..15) of weight 32b+j in its low nibble and of weight 32b+j+16 in its high
//       nibble (GGUF's Q4_0/Q4_1 order). d, m [N, ceil(K/g)] per group of g weights (g a
//       multiple of 32; the last group may be shorter), fp16, bf16 or fp32:  w = d*q + m.
//       Instead of m: 4-bit zero points z (m = -z*d), or nothing (m = -8d, symmetric).
//   Q8: qs int8 [N, K], d fp16 [N, K/32]:  w = d*q.
// Activations stay float32: with w formed exactly as the twin forms it (d*q is exact in fp32
// for 16-bit scales, so fma(q, d, m) rounds as d*q + m does), outputs differ from the twin's
// only in summation order.
//
// Tiles: MR rows of x by NR rows of W; each block is dequantized once per tile and used MR
// times. Threads take chunks of output rows (chunks.h); x stays in cache, each thread
// streams its own weight rows once per MR-row chunk of x (once in all at decode).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "chunks.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera {
namespace {

constexpr int64_t kBlock = 32;

inline float to_f32(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float to_f32(c10::BFloat16 b) { return static_cast<float>(b); }
inline float to_f32(float f) { return f; }

// The offset m comes from its own plane, or from 4-bit zero points z (m = -z * d, packed two
// a byte over the row-major [N, groups], low nibble first), or is -8 d (symmetric codes).
template <typename S>
struct Q4Weights {
  const uint8_t* qs;
  const S* d;
  const S* m;          // or nullptr
  const uint8_t* z;    // or nullptr
  int64_t K, groups, blocks_per_group;
  static constexpr bool kQ8 = false;
  const uint8_t* block(int64_t n, int64_t b) const { return qs + n * (K / 2) + b * 16; }
  float scale(int64_t n, int64_t g) const { return to_f32(d[n * groups + g]); }
  float offset(int64_t n, int64_t g) const {
    if (m != nullptr) return to_f32(m[n * groups + g]);
    float zero = 8.0f;
    if (z != nullptr) {
      const int64_t i = n * groups + g;
      zero = static_cast<float>((z[i >> 1] >> ((i & 1) * 4)) & 0x0F);
    }
    return -zero * scale(n, g);
  }
};

struct Q8Weights {
  const int8_t* qs;
  const c10::Half* d;
  int64_t K, groups, blocks_per_group;  // groups == K / 32, blocks_per_group == 1
  static constexpr bool kQ8 = true;
  const int8_t* block(int64_t n, int64_t b) const { return qs + n * K + b * kBlock; }
  float scale(int64_t n, int64_t g) const { return to_f32(d[n * groups + g]); }
  float offset(int64_t, int64_t) const { return 0.0f; }
};

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

// Past kKernelMaxRows rows of x (prefill, mixed steps, a large decode batch) the register
// tiles above lose to BLAS: tiles of W are dequantized into a thread's buffer, which stays in
// L2, and multiplied by BLAS (one thread per tile). Each weight is decoded once per call and the
// whole matrix is never written out in float32 (113 MB for the default model's lm_head). The
// crossover is below 16 rows here (gate_up 3072x576 at 16 rows: tiles 1.38 ms, F.linear 1.19;
// ops/bench/RESULTS.md#weight-kernels).
constexpr int64_t kKernelMaxRows = 16;

}  // namespace
}  // namespace tessera

// Fortran BLAS, exported by torch's own library (MKL on x86 builds); weak, so a torch without it
// still loads these ops and takes at::mm_out instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));
// MKL's bf16 x bf16 -> fp32 GEMM (AMX or AVX512-BF16 where the CPU has them), CBLAS enums as
// ints (101 row-major, 111 no transpose, 112 transpose); weak like sgemm_.
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k,
                                       float alpha, const uint16_t* a, int lda,
                                       const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

namespace tessera {
namespace {

// y[:, n0:n0+rows] (row stride ldy) = x[M, K] @ tile[rows, K]^T on the calling thread.
inline void tile_matmul(const float* tile, int64_t rows, const float* x, int64_t M, int64_t K,
                        float* y, int64_t ldy) {
  if (sgemm_ != nullptr) {
    // Column-major: y^T[rows, M] (ld ldy) = tile^T^T[rows, K] @ x^T[K, M].
    const int m = static_cast<int>(rows), n = static_cast<int>(M), k = static_cast<int>(K);
    const int lda = k, ldb = k, ldc = static_cast<int>(ldy);
    const float one = 1.0f, zero = 0.0f;
    sgemm_("T", "N", &m, &n, &k, &one, tile, &lda, x, &ldb, &zero, y, &ldc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor xt = at::from_blob(const_cast<float*>(x), {M, K}, opts);
  at::Tensor wt = at::from_blob(const_cast<float*>(tile), {rows, K}, opts);
  at::Tensor yt = at::from_blob(y, {M, rows}, {ldy, 1}, opts);
  at::mm_out(yt, xt, wt.t());
}

template <typename W>
void gemm_dequant(const W& w, const float* x, int64_t M, int64_t N, float* y) {
  const int64_t K = w.K;
  // ~512 KiB of float32 weights per tile (it stays in L2), a multiple of 32 rows.
  const int64_t tile_rows = std::max<int64_t>(32, ((int64_t{1} << 17) / K) / 32 * 32);
  parallel_chunks(N, tile_rows, 0, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> tile;
    tile.resize(tile_rows * K);
    for (int64_t n0 = begin; n0 < end; n0 += tile_rows) {
      const int64_t rows = std::min(end, n0 + tile_rows) - n0;
      for (int64_t r = 0; r < rows; ++r) dequantize_row(w, n0 + r, tile.data() + r * K);
      tile_matmul(tile.data(), rows, x, M, K, y + n0, N);
    }
  });
}

// float32 -> bf16 bits, round to nearest even (finite inputs); a loop the compiler vectorizes.
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = __builtin_bit_cast(uint32_t, src[j]);
    dst[j] = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

// Row n of W rounded to bf16 into dst[K]: the same bits as dequantize_row then to_bf16.
template <typename W>
inline void dequantize_row_bf16(const W& w, int64_t n, float* scratch, uint16_t* dst) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  (void)scratch;
  const int64_t nb = w.K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / w.blocks_per_group;
    const __m512 v = W::kQ8 ? _mm512_set1_ps(w.scale(n, g))
                            : group_lut(w, w.scale(n, g), w.offset(n, g));
    __m512 w0, w1;
    dequant_block(w, n, b, v, w0, w1);
    _mm512_storeu_si512(dst + b * kBlock, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
#else
  dequantize_row(w, n, scratch);
  to_bf16(scratch, dst, w.K);
#endif
}

// y = bf16(x) @ bf16(W)^T with float32 sums: tiles of W dequantized and rounded to bf16 into a
// thread's buffer, multiplied by MKL's bf16 GEMM (AMX here: ~4x its float32 GEMM).
template <typename W>
void gemm_bf16(const W& w, const float* x, int64_t M, int64_t N, float* y) {
  const int64_t K = w.K;
  std::vector<uint16_t> xb(M * K);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    to_bf16(x + b * K, xb.data() + b * K, (e - b) * K);
  });
  // ~512 KiB of bf16 weights per tile, a multiple of 32 rows.
  const int64_t tile_rows = std::max<int64_t>(32, ((int64_t{1} << 18) / K) / 32 * 32);
  parallel_chunks(N, tile_rows, 0, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> tile;
    thread_local std::vector<float> row;
    tile.resize(tile_rows * K);
    row.resize(K);
    for (int64_t n0 = begin; n0 < end; n0 += tile_rows) {
      const int64_t rows = std::min(end, n0 + tile_rows) - n0;
      for (int64_t r = 0; r < rows; ++r)
        dequantize_row_bf16(w, n0 + r, row.data(), tile.data() + r * K);
      cblas_gemm_bf16bf16f32(101, 111, 112, static_cast<int>(M), static_cast<int>(rows),
                             static_cast<int>(K), 1.0f, xb.data(), static_cast<int>(K),
                             tile.data(), static_cast<int>(K), 0.0f, y + n0,
                             static_cast<int>(N));
    }
  });
}

// y = x @ W^T by the register tiles up to kKernelMaxRows rows of x, by dequantized tiles past.
template <typename W>
void linear(const W& w, const float* x, int64_t M, int64_t N, float* y) {
  if (M > kKernelMaxRows) {
    gemm_dequant(w, x, M, N, y);
  } else {
    gemm(w, x, M, N, y);
  }
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
}

int64_t check_q4(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                 const c10::optional<at::Tensor>& zeros, int64_t group_size) {
  TORCH_CHECK(qs.dtype() == at::kByte && qs.dim() == 2 && qs.is_contiguous(),
              "qs must be a contiguous 2-d uint8 tensor");
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0, "group size ", group_size,
              " is not a positive multiple of 32");
  const int64_t groups = (K + group_size - 1) / group_size;
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == groups && d.is_contiguous(),
              "scales must be contiguous [", N, ", ", groups, "]");
  if (m.has_value()) {
    TORCH_CHECK(!zeros.has_value(), "give offsets or zero points, not both");
    TORCH_CHECK(m->dim() == 2 && m->size(0) == N && m->size(1) == groups &&
                    m->is_contiguous() && m->dtype() == d.dtype(),
                "offsets must be contiguous [", N, ", ", groups, "] of the scales' dtype");
  }
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->dtype() == at::kByte && zeros->is_contiguous() &&
                    zeros->numel() * 2 >= N * groups,
                "zero points must be contiguous uint8 holding ", N * groups, " nibbles");
  }
  return K;
}

template <typename Fn>
void with_q4(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
             const c10::optional<at::Tensor>& zeros, int64_t group_size, Fn&& fn) {
  const int64_t K = qs.size(1) * 2, groups = (K + group_size - 1) / group_size;
  const int64_t bpg = group_size / kBlock;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint8_t* z = zeros.has_value() ? zeros->data_ptr<uint8_t>() : nullptr;
  auto run = [&](auto tag) {
    using S = decltype(tag);
    const S* mp = m.has_value() ? m->data_ptr<S>() : nullptr;
    fn(Q4Weights<S>{q, d.data_ptr<S>(), mp, z, K, groups, bpg});
  };
  if (d.dtype() == at::kHalf) {
    run(c10::Half{});
  } else if (d.dtype() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (d.dtype() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(false, "scales must be float16, bfloat16 or float32, got ", d.dtype());
  }
}

Q8Weights q8_weights(const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(qs.dtype() == at::kChar && qs.dim() == 2 && qs.is_contiguous(),
              "qs must be a contiguous 2-d int8 tensor");
  const int64_t N = qs.size(0), K = qs.size(1);
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(d.dtype() == at::kHalf && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == K / kBlock && d.is_contiguous(),
              "scales must be contiguous float16 [", N, ", ", K / kBlock, "]");
  return Q8Weights{qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), K, K / kBlock, 1};
}

}  // namespace

void check_out(const at::Tensor& out, int64_t M, int64_t N) {
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out must be a contiguous float32 [", M, ", ", N, "] tensor");
}

// Every element of `out` is written (the tests poison it first).
void q4_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                   c10::optional<at::Tensor> zeros, int64_t group_size, at::Tensor out) {
  const int64_t K = check_q4(qs, d, m, zeros, group_size);
  check_x(x, K);
  const int64_t M = x.size(0), N = qs.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  with_q4(qs, d, m, zeros, group_size,
          [&](const auto& w) { linear(w, x.data_ptr<float>(), M, N, out.data_ptr<float>()); });
}

bool bf16_gemm_available() { return cblas_gemm_bf16bf16f32 != nullptr; }

// As q4_linear_out with x and W rounded to bf16 (float32 sums) at every row count: the caller
// chooses it for many rows (prefill, large batches), where it is compute-bound.
void q4_linear_bf16_out(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                        c10::optional<at::Tensor> zeros, int64_t group_size, at::Tensor out) {
  TORCH_CHECK(bf16_gemm_available(), "this torch has no bf16 GEMM (bf16_gemm_available)");
  const int64_t K = check_q4(qs, d, m, zeros, group_size);
  check_x(x, K);
  const int64_t M = x.size(0), N = qs.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  with_q4(qs, d, m, zeros, group_size, [&](const auto& w) {
    gemm_bf16(w, x.data_ptr<float>(), M, N, out.data_ptr<float>());
  });
}

void q8_linear_bf16_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out) {
  TORCH_CHECK(bf16_gemm_available(), "this torch has no bf16 GEMM (bf16_gemm_available)");
  const Q8Weights w = q8_weights(qs, d);
  check_x(x, w.K);
  const int64_t M = x.size(0), N = qs.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  gemm_bf16(w, x.data_ptr<float>(), M, N, out.data_ptr<float>());
}

// out[M, N] = bf16(x) @ w^T for a bf16 weight already dequantized (a serving cache of the blocks):
// one MKL call, threaded by MKL itself.
void bf16_linear_out(at::Tensor x, at::Tensor w, at::Tensor out) {
  TORCH_CHECK(bf16_gemm_available(), "this torch has no bf16 GEMM (bf16_gemm_available)");
  TORCH_CHECK(w.dtype() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous 2-d bfloat16 tensor");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  const int64_t M = x.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  std::vector<uint16_t> xb(M * K);
  to_bf16(x.data_ptr<float>(), xb.data(), M * K);
  cblas_gemm_bf16bf16f32(101, 111, 112, static_cast<int>(M), static_cast<int>(N),
                         static_cast<int>(K), 1.0f, xb.data(), static_cast<int>(K),
                         reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                         static_cast<int>(K), 0.0f, out.data_ptr<float>(), static_cast<int>(N));
}

at::Tensor q4_dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                         c10::optional<at::Tensor> zeros, int64_t group_size) {
  const int64_t K = check_q4(qs, d, m, zeros, group_size), N = qs.size(0);
  auto out = at::empty({N, K}, qs.options().dtype(at::kFloat));
  with_q4(qs, d, m, zeros, group_size,
          [&](const auto& w) { dequantize_rows(w, N, out.data_ptr<float>()); });
  return out;
}

void q8_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out) {
  const Q8Weights w = q8_weights(qs, d);
  check_x(x, w.K);
  const int64_t M = x.size(0), N = qs.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  linear(w, x.data_ptr<float>(), M, N, out.data_ptr<float>());
}

at::Tensor q8_dequantize(at::Tensor qs, at::Tensor d) {
  const Q8Weights w = q8_weights(qs, d);
  auto out = at::empty({qs.size(0), w.K}, qs.options().dtype(at::kFloat));
  dequantize_rows(w, qs.size(0), out.data_ptr<float>());
  return out;
}

}  // namespace tessera
