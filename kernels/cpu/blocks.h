// The 32-weight block layout every block kernel reads (qgemv.cpp, qgemv_i8.cpp, the fused
// decode step's projections in decode_llama.cpp): views of the planes and their checks.
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
#pragma once

#include <ATen/ATen.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace tessera {

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

inline void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
}

inline int64_t check_q4(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
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

inline Q8Weights q8_weights(const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(qs.dtype() == at::kChar && qs.dim() == 2 && qs.is_contiguous(),
              "qs must be a contiguous 2-d int8 tensor");
  const int64_t N = qs.size(0), K = qs.size(1);
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(d.dtype() == at::kHalf && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == K / kBlock && d.is_contiguous(),
              "scales must be contiguous float16 [", N, ", ", K / kBlock, "]");
  return Q8Weights{qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), K, K / kBlock, 1};
}

inline void check_out(const at::Tensor& out, int64_t M, int64_t N) {
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out must be a contiguous float32 [", M, ", ", N, "] tensor");
}

}  // namespace tessera
