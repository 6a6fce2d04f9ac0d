// Gather whole (head, page) rows of fp8 e4m3 KV bytes and decode them to float32.
// The decode is the exact integer-bit form (sign and exponent/mantissa bits shifted into an
// fp32 pattern, times 2^120); one pass, no per-call dispatch cost.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "rows.h"

namespace tessera {

at::Tensor gather_e4m3_rows(at::Tensor flat, at::Tensor rows) {
  TORCH_CHECK(flat.dtype() == at::kByte && flat.is_contiguous() && flat.dim() == 2,
              "flat must be a contiguous 2-d uint8 tensor");
  TORCH_CHECK(rows.dtype() == at::kLong && rows.dim() == 1, "rows must be 1-d int64");
  auto rows_c = rows.contiguous();
  const int64_t n = flat.size(1), k = rows_c.size(0), total = flat.size(0);
  auto out = at::empty({k, n}, flat.options().dtype(at::kFloat));
  const uint8_t* src = flat.data_ptr<uint8_t>();
  const int64_t* r = rows_c.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < k; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < total, "row out of range");
  at::parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* s = src + r[i] * n;
      float* d = dst + i * n;
      load_row(s, d, n);
    }
  });
  return out;
}

}  // namespace tessera
