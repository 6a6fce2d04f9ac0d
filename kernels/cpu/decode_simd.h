// The AVX-512 body of paged decode attention (paged_decode.cpp) for head sizes a multiple of
// 16: the same float operations in the same order as the portable loops over rows.h's `dot`,
// `softmax_inplace` and `axpy`, so its bits are theirs (tests/kernels/test_cpu_ops.py compares
// the two), with what those loops pay for done once: a K row is read into registers once for
// all of its GQA group's query heads, the scores of 16 rows are reduced together (one
// shuffle-and-add tree for 16 dots, each dot's partial sums paired exactly as `dot` pairs
// them), and the output rows stay in registers over the whole context.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "rows.h"

namespace tessera {
namespace simd {

constexpr bool kAvailable = true;

// 16 values of a stored K/V row as float32, exactly as rows.h's load_row decodes them.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {  // e4m3 bytes, placed as fp16 (2^-8 times the value, exactly) and widened:
    // the 2^-120 float patterns of rows.h's load_row are denormal for small codes, and a
    // multiply of a denormal costs a microcode assist; the same values, exactly
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
  }
}

// The 16 totals of a[0..15] (16 lanes of partial sums each), total i in lane i, each summed by
// `dot`'s tree: lane l + lane l+8, then + 4, + 2, + 1 (float adds commute bit for bit; the
// pairing is what fixes the result).
inline __m512 reduce16(const __m512* a) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i)  // [a lanes 0-7 + 8-15 | b's]
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter k: accumulator 4i + k, lanes 0-3 + 4-7
    s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter k: [acc 8i+k: 0+2, 1+3 | acc 8i+4+k: 0+2, 1+3]
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter k, element j: the total of accumulator 4j + k
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s1);
}

// Slots of a sequence's rows in order: table[t / page_size] * page_size + t % page_size,
// without a division a row.
class Slots {
 public:
  Slots(const int64_t* table, int64_t page_size) : table_(table), page_size_(page_size) {}
  int64_t next() {
    const int64_t at = table_[page_] * page_size_ + offset_;
    if (++offset_ == page_size_) {
      offset_ = 0;
      ++page_;
    }
    return at;
  }

 private:
  const int64_t* table_;
  int64_t page_size_, page_ = 0, offset_ = 0;
};

// Rows ahead of the one being read whose cache lines are prefetched: K/V pages are scattered
// and a page is often one 4 KiB memory page, where the hardware prefetcher stops.
constexpr int64_t kAhead = 16;

template <typename T, int kDim>
inline void prefetch_row(const T* row) {
  constexpr int64_t kBytes = kDim * static_cast<int64_t>(sizeof(T));
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// Slots `kAhead` rows ahead of a `Slots` walk over `len` rows, prefetched one a row.
template <typename T, int kDim>
class Prefetcher {
 public:
  Prefetcher(const T* base, const int64_t* table, int64_t page_size, int64_t len)
      : base_(base), slots_(table, page_size), left_(len) {
    for (int64_t i = 0; i < kAhead && left_ > 0; ++i, --left_)
      prefetch_row<T, kDim>(base_ + slots_.next() * kDim);
  }
  void step() {
    if (left_ <= 0) return;
    --left_;
    prefetch_row<T, kDim>(base_ + slots_.next() * kDim);
  }

 private:
  const T* base_;
  Slots slots_;
  int64_t left_;
};

// Scores of kHeads query heads (q: [kHeads, kDim]) over `len` K rows into probs
// ([kHeads rows of stride len]): dot(q, k_t) * (k_scale[t] * scale or scale), as the
// portable loop computes them.
template <typename T, int kDim, int kHeads>
void scores(const float* q, const T* kbase, const c10::BFloat16* ks, const int64_t* table,
            int64_t len, int64_t page_size, float scale, float* probs) {
  constexpr int kV = kDim / 16;
  __m512 qr[kHeads][kV];
  for (int g = 0; g < kHeads; ++g)
    for (int c = 0; c < kV; ++c) qr[g][c] = _mm512_loadu_ps(q + g * kDim + 16 * c);
  alignas(64) __m512 partial[kHeads][16];
  Slots slots(table, page_size);
  Prefetcher<T, kDim> ahead(kbase, table, page_size, len);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, len - t0));
    alignas(64) float row_scale[16];
    for (int r = 0; r < rows; ++r) {
      const int64_t at = slots.next();
      ahead.step();
      const T* kr = kbase + at * kDim;
      row_scale[r] = ks ? bf16_to_float(ks[at]) * scale : scale;
      __m512 kv[kV];
      for (int c = 0; c < kV; ++c) kv[c] = load16(kr + 16 * c);
      for (int g = 0; g < kHeads; ++g) {
        __m512 acc = _mm512_fmadd_ps(qr[g][0], kv[0], _mm512_setzero_ps());
        for (int c = 1; c < kV; ++c) acc = _mm512_fmadd_ps(qr[g][c], kv[c], acc);
        partial[g][r] = acc;
      }
    }
    for (int r = rows; r < 16; ++r) {
      row_scale[r] = 0.0f;
      for (int g = 0; g < kHeads; ++g) partial[g][r] = _mm512_setzero_ps();
    }
    const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512 rs = _mm512_load_ps(row_scale);
    for (int g = 0; g < kHeads; ++g)
      _mm512_mask_storeu_ps(probs + g * len + t0, live,
                            _mm512_mul_ps(reduce16(partial[g]), rs));
  }
}

// out[g] = sum_t probs[g][t] * (v_scale[t] or 1) * v_t for kHeads heads, accumulated in t order
// (as `axpy` row after row), in registers.
template <typename T, int kDim, int kHeads>
void weighted_values(const float* probs, const T* vbase, const c10::BFloat16* vs,
                     const int64_t* table, int64_t len, int64_t page_size, float* out) {
  constexpr int kV = kDim / 16;
  __m512 acc[kHeads][kV];
  for (int g = 0; g < kHeads; ++g)
    for (int c = 0; c < kV; ++c) acc[g][c] = _mm512_setzero_ps();
  Slots slots(table, page_size);
  Prefetcher<T, kDim> ahead(vbase, table, page_size, len);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t at = slots.next();
    ahead.step();
    const T* vr = vbase + at * kDim;
    const float vsc = vs ? bf16_to_float(vs[at]) : 1.0f;
    __m512 vv[kV];
    for (int c = 0; c < kV; ++c) vv[c] = load16(vr + 16 * c);
    for (int g = 0; g < kHeads; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + t] * vsc);
      for (int c = 0; c < kV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int c = 0; c < kV; ++c) _mm512_storeu_ps(out + g * kDim + 16 * c, acc[g][c]);
}

// fn(std::integral_constant<int, n>) for a run-time n in [1, kMax].
template <int kMax, typename F>
void with_heads(int64_t n, const F& fn) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_heads<kMax - 1>(n, fn);
  }
  fn(std::integral_constant<int, kMax>());
}

// One (sequence, KV head) work item: q [group, kDim] (already rotated / scaled where the pages
// want it), the sequence's `len` K and V rows at page table[t / page_size], row
// t % page_size of this KV head's pages (kbase, vbase); ks / vs their per-row bf16 scales (null
// for unscaled formats); probs: scratch of group * len floats; out: [group, kDim].
template <typename T, int kDim>
void decode_item(const float* q, const T* kbase, const T* vbase, const c10::BFloat16* ks,
                 const c10::BFloat16* vs, const int64_t* table, int64_t len, int64_t page_size,
                 float scale, int64_t group, float* probs, float* out) {
  constexpr int kV = kDim / 16;
  constexpr int kTile = kV <= 4 ? 16 / kV : 1;  // query heads a pass: <= 16 registers of q
  static_assert(kDim % 16 == 0 && kV <= 16, "head_dim a multiple of 16, at most 256");
  for (int64_t g0 = 0; g0 < group; g0 += kTile)
    with_heads<kTile>(std::min<int64_t>(kTile, group - g0), [&](auto heads) {
      scores<T, kDim, decltype(heads)::value>(q + g0 * kDim, kbase, ks, table, len, page_size,
                                              scale, probs + g0 * len);
    });
  for (int64_t g = 0; g < group; ++g) softmax_inplace(probs + g * len, len);
  for (int64_t g0 = 0; g0 < group; g0 += kTile)
    with_heads<kTile>(std::min<int64_t>(kTile, group - g0), [&](auto heads) {
      weighted_values<T, kDim, decltype(heads)::value>(probs + g0 * len, vbase, vs, table, len,
                                                       page_size, out + g0 * kDim);
    });
}

}  // namespace simd
}  // namespace tessera

#else
namespace tessera::simd {
constexpr bool kAvailable = false;
}
#endif
