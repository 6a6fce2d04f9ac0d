// Decode attention straight from KV pages: one query token per sequence, pages read in their
// storage format (fp32 / bf16 / fp16, or e4m3 bytes or int8 codes with a bf16 scale per token
// and head) and decoded a row at a time into registers-sized buffers, never into a gathered
// copy.
// One work item per (sequence, KV head): its query heads (GQA group) share every K/V row read.
// Pages stored Hadamard-rotated (see kernels/hadamard.py) are read with q rotated the same way
// and the output rotated back: two dim-sized transforms per query head, none per K/V row.
// Smoothed pages (runtime/kv/smoothing.py) take q times a per-(KV head, channel) scale before the
// rotation and multiply the output by another after it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "chunks.h"
#include "decode_simd.h"
#include "rows.h"

namespace tessera {
namespace {

// The portable body of one (sequence, KV head) item: scores, softmax, weighted values, row by
// row through rows.h (decode_simd.h has the same operations in registers).
template <typename T>
void portable_item(const float* qg, const T* k, const T* v, const c10::BFloat16* k_scale,
                   const c10::BFloat16* v_scale, const int64_t* pt, int64_t len, int64_t h,
                   int64_t pages, int64_t page_size, int64_t dim, float scale, int64_t group,
                   float* rw, float* pr, float* ac) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = (h * pages + pt[t / page_size]) * page_size + t % page_size;
    const float* kr = rw;
    if constexpr (std::is_same_v<T, float>) {
      kr = k + slot * dim;  // float pages are read in place, not copied
    } else {
      load_row(k + slot * dim, rw, dim);
    }
    const float ks = k_scale ? bf16_to_float(k_scale[slot]) * scale : scale;
    for (int64_t g = 0; g < group; ++g) pr[g * len + t] = dot(qg + g * dim, kr, dim) * ks;
  }
  for (int64_t g = 0; g < group; ++g) softmax_inplace(pr + g * len, len);
  std::fill(ac, ac + group * dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = (h * pages + pt[t / page_size]) * page_size + t % page_size;
    const float* vr = rw;
    if constexpr (std::is_same_v<T, float>) {
      vr = v + slot * dim;
    } else {
      load_row(v + slot * dim, rw, dim);
    }
    const float vs = v_scale ? bf16_to_float(v_scale[slot]) : 1.0f;
    for (int64_t g = 0; g < group; ++g) axpy(pr[g * len + t] * vs, vr, ac + g * dim, dim);
  }
}

// kDim > 0 fixes head_dim at compile time (fully unrolled rows); 0 reads it at run time.
template <typename T, int kDim>
void decode_attention(const float* q, const T* k, const T* v, const c10::BFloat16* k_scale,
                      const c10::BFloat16* v_scale, const int64_t* table, const int64_t* lens,
                      float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t pages,
                      int64_t page_size, int64_t run_dim, int64_t max_pages, float scale,
                      bool hadamard, const float* q_scale, const float* out_scale) {
  const int64_t dim = kDim > 0 ? kDim : run_dim;
  const int64_t group = heads / kv_heads;
  parallel_chunks(batch * kv_heads, 1, 1, [&](int64_t begin, int64_t end) {
    const bool prep = hadamard || q_scale;
    std::vector<float> row(dim), acc(group * dim), probs, q_rot(prep ? group * dim : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = lens[b];
      const float* qg = q + (b * heads + h * group) * dim;
      if (prep) {
        std::copy(qg, qg + group * dim, q_rot.begin());
        for (int64_t g = 0; g < group; ++g) {
          float* qr = q_rot.data() + g * dim;
          if (q_scale)
            for (int64_t j = 0; j < dim; ++j) qr[j] *= q_scale[h * dim + j];
          if (hadamard) fwht_inplace<kDim>(qr, dim);
        }
        qg = q_rot.data();
      }
      const int64_t* pt = table + b * max_pages;
      probs.resize(group * len);
      float* pr = probs.data();
      float* ac = acc.data();
      if constexpr (simd::kAvailable && kDim > 0 && kDim % 16 == 0) {
        const int64_t head_rows = h * pages * page_size;
        simd::decode_item<T, kDim>(qg, k + head_rows * kDim, v + head_rows * kDim,
                                   k_scale ? k_scale + head_rows : nullptr,
                                   v_scale ? v_scale + head_rows : nullptr, pt, len, page_size,
                                   scale, group, pr, ac);
      } else {
        portable_item(qg, k, v, k_scale, v_scale, pt, len, h, pages, page_size, dim, scale,
                      group, row.data(), pr, ac);
      }
      for (int64_t g = 0; g < group; ++g) {
        if (hadamard) fwht_inplace<kDim>(ac + g * dim, dim);
        if (out_scale)
          for (int64_t j = 0; j < dim; ++j) ac[g * dim + j] *= out_scale[h * dim + j];
      }
      std::copy(acc.begin(), acc.end(), out + (b * heads + h * group) * dim);
    }
  });
}

template <typename T>
void dispatch_dim(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const c10::BFloat16* ks, const c10::BFloat16* vs, const int64_t* table,
                  const int64_t* lens, float* out, int64_t batch, int64_t heads, float scale,
                  int64_t max_pages, bool hadamard, const float* q_scale,
                  const float* out_scale) {
  const int64_t kv_heads = k_cache.size(0), pages = k_cache.size(1);
  const int64_t page_size = k_cache.size(2), dim = k_cache.size(3);
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  auto run = [&](auto fixed) {
    decode_attention<T, decltype(fixed)::value>(q, k, v, ks, vs, table, lens, out, batch, heads,
                                                kv_heads, pages, page_size, dim, max_pages,
                                                scale, hadamard, q_scale, out_scale);
  };
  if (dim == 64) run(std::integral_constant<int, 64>());
  else if (dim == 128) run(std::integral_constant<int, 128>());
  else run(std::integral_constant<int, 0>());
}

void check_cache(const at::Tensor& cache, const at::Tensor& like, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), name, " must be contiguous 4-d");
  TORCH_CHECK(cache.sizes() == like.sizes() && cache.dtype() == like.dtype(),
              name, " must match k_cache in shape and dtype");
}

}  // namespace

// q: [batch, heads, dim] float32; caches: [kv_heads, pages, page_size, dim];
// page_table: [batch, max_pages] int64; context_lens: [batch] int64 (tokens to attend, >= 1);
// scales (quantized pages only: e4m3 uint8 or int8): [kv_heads, pages, page_size] bf16.
// Returns [batch, heads * dim].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor page_table,
                                     at::Tensor context_lens, double scale,
                                     c10::optional<at::Tensor> k_scale,
                                     c10::optional<at::Tensor> v_scale, bool hadamard,
                                     c10::optional<at::Tensor> q_scale,
                                     c10::optional<at::Tensor> out_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [batch, heads, dim] float32");
  check_cache(k_cache, k_cache, "k_cache");
  check_cache(v_cache, k_cache, "v_cache");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), pages = k_cache.size(1), page_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "q and caches disagree on shape");
  auto table = page_table.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == batch,
              "page_table must be [batch, max_pages] int64");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == batch,
              "context_lens must be [batch] int64");
  const int64_t max_pages = table.size(1);
  const int64_t* pt = table.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= max_pages * page_size, "context length out of range");
    for (int64_t i = 0; i < (ln[b] + page_size - 1) / page_size; ++i)
      TORCH_CHECK(pt[b * max_pages + i] >= 0 && pt[b * max_pages + i] < pages,
                  "page id out of range");
  }
  const bool quantized = k_cache.scalar_type() == at::kByte || k_cache.scalar_type() == at::kChar;
  hadamard = hadamard && quantized;  // only quantized (e4m3 or int8) pages are stored rotated
  TORCH_CHECK(!hadamard || (dim >= 2 && (dim & (dim - 1)) == 0),
              "the Hadamard rotation needs a power-of-two head_dim");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "quantized pages need k_scale and v_scale, other formats none");
  const c10::BFloat16* ks = nullptr;
  const c10::BFloat16* vs = nullptr;
  at::Tensor ksc, vsc;
  if (quantized) {
    ksc = k_scale->contiguous();
    vsc = v_scale->contiguous();
    for (auto* s : {&ksc, &vsc})
      TORCH_CHECK(s->scalar_type() == at::kBFloat16 && s->dim() == 3 &&
                      s->size(0) == kv_heads && s->size(1) == pages && s->size(2) == page_size,
                  "scales must be [kv_heads, pages, page_size] bf16");
    ks = ksc.data_ptr<c10::BFloat16>();
    vs = vsc.data_ptr<c10::BFloat16>();
  }
  // q_scale / out_scale: [kv_heads, dim] float32, or none
  at::Tensor qsc, osc;
  for (auto [opt, dst] : {std::pair{&q_scale, &qsc}, std::pair{&out_scale, &osc}}) {
    if (!opt->has_value()) continue;
    *dst = (*opt)->contiguous();
    TORCH_CHECK(dst->scalar_type() == at::kFloat && dst->numel() == kv_heads * dim,
                "q_scale and out_scale must be [kv_heads, head_dim] float32");
  }
  const float* qs = qsc.defined() ? qsc.data_ptr<float>() : nullptr;
  const float* os = osc.defined() ? osc.data_ptr<float>() : nullptr;
  auto qc = q.contiguous();
  auto out = at::empty({batch, heads * dim}, q.options());
  const float s = static_cast<float>(scale);
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (k_cache.scalar_type()) {
    case at::kByte:
      dispatch_dim<uint8_t>(qp, k_cache, v_cache, ks, vs, pt, ln, op, batch, heads, s, max_pages,
                            hadamard, qs, os);
      break;
    case at::kChar:
      dispatch_dim<int8_t>(qp, k_cache, v_cache, ks, vs, pt, ln, op, batch, heads, s, max_pages,
                           hadamard, qs, os);
      break;
    case at::kBFloat16:
      dispatch_dim<c10::BFloat16>(qp, k_cache, v_cache, ks, vs, pt, ln, op, batch, heads, s,
                                  max_pages, false, qs, os);
      break;
    case at::kHalf:
      dispatch_dim<c10::Half>(qp, k_cache, v_cache, ks, vs, pt, ln, op, batch, heads, s,
                              max_pages, false, qs, os);
      break;
    case at::kFloat:
      dispatch_dim<float>(qp, k_cache, v_cache, ks, vs, pt, ln, op, batch, heads, s, max_pages,
                          false, qs, os);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV page dtype ", k_cache.scalar_type());
  }
  return out;
}

}  // namespace tessera
