// Residual add + RMSNorm in one pass over each row (the decode step's most frequent small op:
// two a layer): x += delta (in place, when delta is given), then
// out = x * (1 / sqrt(mean(x^2) + eps)) * weight, float32. One call instead of torch's
// add_ + five-op rms_norm; the mean's summation order differs from torch's (16 lanes, then
// a tree), so results match `kernels.norm.ref_add_rms_norm` to float32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace tessera {
namespace {

inline float sum_squares(const float* __restrict__ x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[j + l] * x[j + l];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  float s = acc[0];
  for (; j < n; ++j) s += x[j] * x[j];
  return s;
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight,
                        double eps) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-d float32 tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.dim() == 1 && weight.size(0) == n &&
                  weight.is_contiguous(),
              "weight must be contiguous float32 [", n, "]");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.dtype() == at::kFloat && d.sizes() == x.sizes(),
                "delta must be float32 of x's shape");
  }
  auto out = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = d.defined() ? d.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // ~64k elements a task: a decode step's few rows stay on the calling thread.
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      if (dp != nullptr) {
        const float* __restrict__ dr = dp + r * n;
        for (int64_t j = 0; j < n; ++j) xr[j] += dr[j];
      }
      const float rstd = 1.0f / std::sqrt(sum_squares(xr, n) / static_cast<float>(n) + e);
      float* __restrict__ orow = op + r * n;
      for (int64_t j = 0; j < n; ++j) orow[j] = (xr[j] * rstd) * wp[j];
    }
  });
  return out;
}

}  // namespace tessera
