// The float32 block linears' entry points: y[M, N] = x[M, K] @ W^T over the block layout
// (blocks.h), W read as stored. Up to kKernelMaxRows rows of x the register tiles
// (qgemv_tiles.h) dequantize each block in registers; past that dequantized tiles of W go to
// BLAS (qgemv_blas.h). `block_linear_out` is the one choice of kernel for a block linear
// (float32 or int8-limb activations, Q4 or Q8) that the module (runtime/quant/blocks.py) and
// the fused decode step (decode_llama.cpp) both call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "blocks.h"
#include "ops.h"
#include "qgemv_blas.h"
#include "qgemv_tiles.h"

#include <cstdint>

namespace tessera {
namespace {

// Past kKernelMaxRows rows of x (prefill, mixed steps, a large decode batch) the register
// tiles lose to BLAS: tiles of W are dequantized into a thread's buffer, which stays in
// L2, and multiplied by BLAS (one thread per tile). Each weight is decoded once per call and the
// whole matrix is never written out in float32 (113 MB for the default model's lm_head). The
// crossover is below 16 rows here (gate_up 3072x576 at 16 rows: tiles 1.38 ms, F.linear 1.19;
// ops/bench/RESULTS.md#weight-kernels).
constexpr int64_t kKernelMaxRows = 16;

// y = x @ W^T by the register tiles up to kKernelMaxRows rows of x, by dequantized tiles past.
template <typename W>
void linear(const W& w, const float* x, int64_t M, int64_t N, float* y) {
  if (M > kKernelMaxRows) {
    blas::gemm_dequant(w, x, M, N, y);
  } else {
    tiles::gemm(w, x, M, N, y);
  }
}

}  // namespace

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

void q8_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out) {
  const Q8Weights w = q8_weights(qs, d);
  check_x(x, w.K);
  const int64_t M = x.size(0), N = qs.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  linear(w, x.data_ptr<float>(), M, N, out.data_ptr<float>());
}

// The kernel for a block linear: with `limbs` > 0, x in that many int8 limbs (qgemv_i8.cpp: Q4
// planes need their offsets m, group 32) at every row count, so a row's bits never depend on how
// many rows share the step (batch invariance: docs/DESIGN.md); else float32 x. Q8 planes are
// int8 `qs`, Q4 planes uint8.
void block_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> zeros, int64_t group_size, int64_t limbs,
                      at::Tensor out) {
  const bool i8 = limbs > 0;
  if (qs.scalar_type() == at::kChar) {
    TORCH_CHECK(!m.has_value() && !zeros.has_value() && group_size == kBlock,
                "Q8 planes take no offsets or zero points and groups of 32");
    i8 ? q8_linear_i8_out(x, qs, d, out, limbs) : q8_linear_out(x, qs, d, out);
  } else if (i8) {
    TORCH_CHECK(m.has_value() && !zeros.has_value() && group_size == kBlock,
                "int8 activations need Q4 planes with offsets (m) in groups of 32");
    q4_linear_i8_out(x, qs, d, *m, out, limbs);
  } else {
    q4_linear_out(x, qs, d, m, zeros, group_size, out);
  }
}

at::Tensor q4_dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                         c10::optional<at::Tensor> zeros, int64_t group_size) {
  const int64_t K = check_q4(qs, d, m, zeros, group_size), N = qs.size(0);
  auto out = at::empty({N, K}, qs.options().dtype(at::kFloat));
  with_q4(qs, d, m, zeros, group_size,
          [&](const auto& w) { tiles::dequantize_rows(w, N, out.data_ptr<float>()); });
  return out;
}

at::Tensor q8_dequantize(at::Tensor qs, at::Tensor d) {
  const Q8Weights w = q8_weights(qs, d);
  auto out = at::empty({qs.size(0), w.K}, qs.options().dtype(at::kFloat));
  tiles::dequantize_rows(w, qs.size(0), out.data_ptr<float>());
  return out;
}

bool bf16_gemm_available() { return cblas_gemm_bf16bf16f32 != nullptr; }

// out[M, N] = bf16(x) @ w^T for a bf16 weight already dequantized (BlockLinear's copy of its
// blocks while the engine runs many-row steps with bf16 activations).
void bf16_linear_out(at::Tensor x, at::Tensor w, at::Tensor out) {
  TORCH_CHECK(bf16_gemm_available(), "this torch has no bf16 GEMM (bf16_gemm_available)");
  TORCH_CHECK(w.dtype() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous 2-d bfloat16 tensor");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  const int64_t M = x.size(0);
  check_out(out, M, N);
  if (M == 0 || N == 0) return;
  blas::linear_bf16(x.data_ptr<float>(), M, K,
                    reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N,
                    out.data_ptr<float>());
}

}  // namespace tessera
