// The BLAS paths of the block kernels (qgemv.cpp): many rows of x against tiles of W
// dequantized into a thread's buffer (float32 sgemm), and bf16 x against a bf16 weight copy.
#pragma once

#include <ATen/ATen.h>

#include "blocks.h"
#include "chunks.h"
#include "qgemv_tiles.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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
namespace blas {

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
      for (int64_t r = 0; r < rows; ++r) tiles::dequantize_row(w, n0 + r, tile.data() + r * K);
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

// y[M, N] = bf16(x[M, K]) @ w[N, K]^T (w bf16 bits), float32 sums: one MKL call, threaded by MKL.
inline void linear_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                        float* y) {
  std::vector<uint16_t> xb(M * K);
  to_bf16(x, xb.data(), M * K);
  cblas_gemm_bf16bf16f32(101, 111, 112, static_cast<int>(M), static_cast<int>(N),
                         static_cast<int>(K), 1.0f, xb.data(), static_cast<int>(K), w,
                         static_cast<int>(K), 0.0f, y, static_cast<int>(N));
}

}  // namespace blas
}  // namespace tessera
