// Shared helpers of the CPU ops: decode one row of a KV page (any storage format) into
// float32, and a branch-free exp the compiler can vectorize (libm's expf is a scalar call per
// element).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tessera {

inline float bits_to_float(uint32_t bits) { return __builtin_bit_cast(float, bits); }

// e4m3fn bits shifted into an fp32 pattern are the value times 2^-120: exact for every finite
// byte (0x7F / 0xFF are NaN in e4m3fn and are never written).
inline void load_row(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    uint32_t x = src[j];
    dst[j] = bits_to_float(((x & 0x80u) << 24) | ((x & 0x7Fu) << 20)) * 0x1p120f;
  }
}

// Symmetric int8 codes (kernels/int8.py): the value before its row's scale.
inline void load_row(const int8_t* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t j = 0; j < n; ++j) dst[j] = bits_to_float(static_cast<uint32_t>(s[j]) << 16);
}

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline float bf16_to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2/2, and a
// degree-6 Taylor polynomial for exp(r); relative error ~2e-7. Below -87 it returns ~0.
// n is rounded by adding 1.5 * 2^23 (its integer lands in the low mantissa bits), which the
// compiler vectorizes where floor() and float-to-int casts may not be.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = x < -87.0f ? -87.0f : x;
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
  float p = 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t biased = __builtin_bit_cast(uint32_t, shifted) - 0x4B400000u + 127u;
  return p * bits_to_float(biased << 23);
}

// x <- x H, H the Sylvester Hadamard matrix / sqrt(n), n a power of two: log2(n) butterfly
// stages then one multiply, in the order of `kernels.hadamard.fwht`, so results are bit for
// bit its torch twin's (QuaRot's online Hadamard on K and V). kN > 0 fixes n at compile time:
// the stages unroll and vectorize, ~3x faster than the run-time loop for n = 64.
template <int kN = 0>
inline void fwht_inplace(float* __restrict__ x, int64_t run_n) {
  const int64_t n = kN > 0 ? kN : run_n;
#pragma GCC unroll 8
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t j = 0; j < n; ++j) x[j] *= norm;
}

// The rotation for any power-of-two n, with the common head sizes at compile time.
inline void fwht_any(float* __restrict__ x, int64_t n) {
  if (n == 64) fwht_inplace<64>(x, n);
  else if (n == 128) fwht_inplace<128>(x, n);
  else fwht_inplace<0>(x, n);
}

// Dot product with independent lane accumulators, so it vectorizes without -ffast-math.
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  // NOTE: a tree, not a running sum: 16 dependent adds would cost more than the products.
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  float s = acc[0];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// y += a * x; restrict: the compiler need not reload x after each store to y.
inline void axpy(float a, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// Softmax over p[0, n), in place. Separate passes so that each one vectorizes (a running sum
// inside the exp loop would not, without reassociating float adds).
inline void softmax_inplace(float* __restrict__ p, int64_t n) {
  constexpr int kLanes = 16;
  float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = p[0];
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) lane_max[l] = std::max(lane_max[l], p[t + l]);
  float m = lane_max[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, lane_max[l]);
  for (; t < n; ++t) m = std::max(m, p[t]);
  for (t = 0; t < n; ++t) p[t] = exp_nonpositive(p[t] - m);
  float acc[kLanes] = {0};
  t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += p[t + l];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  float sum = acc[0];
  for (; t < n; ++t) sum += p[t];
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) p[j] *= inv;
}

}  // namespace tessera
