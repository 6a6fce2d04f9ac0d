// SwiGLU's activation, silu(gate) * up over a fused gate_up row [gate (I) | up (I)], in one
// pass: sigmoid through rows.h's exp of a non-positive argument (exp(-|g|), so nothing
// overflows), then (g * sigmoid(g)) * u. Each element's result depends on its value alone
// (batch invariance); the loop is plain C++ that the compiler vectorizes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "rows.h"

namespace tessera {

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous(),
              "gate_up must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up has ", gate_up.size(1),
              " columns: gate and up need an even count");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1), n = width / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  // ~64k elements a task: a decode step's few rows stay on the calling thread.
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ g = src + r * width;
      const float* __restrict__ u = g + n;
      float* __restrict__ o = dst + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const float e = exp_nonpositive(-std::fabs(g[j]));
        const float s = (g[j] >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[j] = (g[j] * s) * u[j];
      }
    }
  });
  return out;
}

}  // namespace tessera
