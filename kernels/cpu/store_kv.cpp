// Write new tokens' K or V rows into their page slots in one pass: a cast for fp32 / bf16 /
// fp16 pages; for e4m3 pages (uint8) the same quantization as `kernels.fp8.quantize_fp8_kv`
// (bf16 scale = amax / 448 rounded to nearest even, floored at 1e-12; NaN -> 0, +-inf -> +-896
// before dividing by the rounded scale; clamp to +-448; round to nearest even), and for int8
// pages `kernels.int8.quantize_int8_kv`'s (the same with 127 for 448, then round to nearest
// even), bit for bit, optionally after the row's Walsh-Hadamard rotation (`fwht_inplace`), and
// before that a per-(head, channel) smoothing (x - shift) / divisor (runtime/kv/smoothing.py),
// in the twin's order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "rows.h"

namespace tessera {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kInt8Max = 127.0f;

// The 1-byte formats: e4m3 bytes (uint8) and symmetric int8. kMax is the code range's bound.
template <typename T>
struct Codes;

template <>
struct Codes<uint8_t> {
  static constexpr float kMax = kFp8Max;
  static uint8_t encode(float v) { return c10::Float8_e4m3fn(v).x; }
};

template <>
struct Codes<int8_t> {
  static constexpr float kMax = kInt8Max;
  // NOTE: nearbyint rounds ties to even in the default rounding mode, as torch.round does.
  static int8_t encode(float v) { return static_cast<int8_t>(std::nearbyint(v)); }
};

template <typename T>
void quantize_row(const float* x, T* dst, c10::BFloat16* scale_out, int64_t dim) {
  constexpr float kMax = Codes<T>::kMax;
  float amax = 0.0f;
  bool nan = false;
  for (int64_t j = 0; j < dim; ++j) {
    nan |= std::isnan(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  if (nan) amax = 0.0f;  // torch's amax propagates NaN; the twins map it to 0
  if (std::isinf(amax)) amax = FLT_MAX;
  const c10::BFloat16 s(std::max(amax / kMax, 1e-12f));
  *scale_out = s;
  const float sf = static_cast<float>(s);
  for (int64_t j = 0; j < dim; ++j) {
    float v = x[j];
    if (std::isnan(v)) v = 0.0f;
    else if (std::isinf(v)) v = v > 0 ? 2 * kMax : -2 * kMax;
    v = std::min(std::max(v / sf, -kMax), kMax);
    dst[j] = Codes<T>::encode(v);
  }
}

// x: [tokens, heads, dim] float32 rows into quantized pages (T: uint8 e4m3 or int8) with one
// bf16 scale per slot; shp / dvp: [heads, dim] smoothing or null.
template <typename T>
void quantize_rows(const float* xp, T* cp, c10::BFloat16* scp, const int64_t* sp, int64_t tokens,
                   int64_t heads, int64_t slots_per_head, int64_t dim, bool hadamard,
                   const float* shp, const float* dvp) {
  const bool prep = hadamard || shp || dvp;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(prep ? dim : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads, at = h * slots_per_head + sp[t];
      const float* row = xp + i * dim;
      if (prep) {
        float* r = rotated.data();
        std::copy(row, row + dim, r);
        if (shp)
          for (int64_t j = 0; j < dim; ++j) r[j] -= shp[h * dim + j];
        if (dvp)
          for (int64_t j = 0; j < dim; ++j) r[j] /= dvp[h * dim + j];
        if (hadamard) fwht_any(r, dim);
        row = r;
      }
      quantize_row(row, cp + at * dim, scp + at, dim);
    }
  });
}

template <typename T>
void cast_rows(const float* x, T* cache, const int64_t* slots, int64_t tokens, int64_t heads,
               int64_t slots_per_head, int64_t dim) {
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const float* src = x + i * dim;
      T* dst = cache + (h * slots_per_head + slots[t]) * dim;
      for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<T>(src[j]);
    }
  });
}

}  // namespace

// x: [tokens, kv_heads, dim] float32; cache: [kv_heads, pages, page_size, dim];
// slots: [tokens] int64 flat slot (page * page_size + offset); scale: quantized (e4m3 uint8 or
// int8) pages only, [kv_heads, pages, page_size] bf16; hadamard: their rows are rotated first
// (dim a power of 2). shift, divisor: [heads, dim] float32 or none (quantized pages only).
void store_kv_rows(at::Tensor x, at::Tensor cache, at::Tensor slots,
                   c10::optional<at::Tensor> scale, bool hadamard,
                   c10::optional<at::Tensor> shift, c10::optional<at::Tensor> divisor) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be [tokens, heads, dim] float32");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "cache must be contiguous 4-d");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cache.size(0) == heads && cache.size(3) == dim, "x and cache disagree on shape");
  const int64_t slots_per_head = cache.size(1) * cache.size(2);
  auto sl = slots.contiguous();
  TORCH_CHECK(sl.scalar_type() == at::kLong && sl.numel() == tokens, "slots must be [tokens] int64");
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_per_head, "slot out of range");
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const bool quantized = cache.scalar_type() == at::kByte || cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || (!shift.has_value() && !divisor.has_value()),
              "smoothing is for quantized (e4m3 or int8) pages");
  switch (cache.scalar_type()) {
    case at::kByte:
    case at::kChar: {
      TORCH_CHECK(!hadamard || (dim >= 2 && (dim & (dim - 1)) == 0),
                  "the Hadamard rotation needs a power-of-two head_dim");
      TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kBFloat16 &&
                      scale->is_contiguous() && scale->numel() == heads * slots_per_head,
                  "quantized pages need a contiguous [kv_heads, pages, page_size] bf16 scale");
      at::Tensor shc, dvc;
      for (auto [opt, dst] : {std::pair{&shift, &shc}, std::pair{&divisor, &dvc}}) {
        if (!opt->has_value()) continue;
        *dst = (*opt)->contiguous();
        TORCH_CHECK(dst->scalar_type() == at::kFloat && dst->numel() == heads * dim,
                    "shift and divisor must be [heads, dim] float32");
      }
      const float* shp = shc.defined() ? shc.data_ptr<float>() : nullptr;
      const float* dvp = dvc.defined() ? dvc.data_ptr<float>() : nullptr;
      c10::BFloat16* scp = scale->data_ptr<c10::BFloat16>();
      if (cache.scalar_type() == at::kByte)
        quantize_rows(xp, cache.data_ptr<uint8_t>(), scp, sp, tokens, heads, slots_per_head, dim,
                      hadamard, shp, dvp);
      else
        quantize_rows(xp, cache.data_ptr<int8_t>(), scp, sp, tokens, heads, slots_per_head, dim,
                      hadamard, shp, dvp);
      break;
    }
    case at::kBFloat16:
      cast_rows(xp, cache.data_ptr<c10::BFloat16>(), sp, tokens, heads, slots_per_head, dim);
      break;
    case at::kHalf:
      cast_rows(xp, cache.data_ptr<c10::Half>(), sp, tokens, heads, slots_per_head, dim);
      break;
    case at::kFloat:
      cast_rows(xp, cache.data_ptr<float>(), sp, tokens, heads, slots_per_head, dim);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV page dtype ", cache.scalar_type());
  }
}

}  // namespace tessera
