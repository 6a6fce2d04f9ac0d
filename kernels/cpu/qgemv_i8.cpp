// Block linear layers with int8 activations (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 idea):
// y[M, N] = x[M, K] @ W^T, x quantized per row and per block of 32 to int8 with one fp32
// scale (dx = amax / 127, q = round-half-even(x * 127 / amax)), then AVX-512 VNNI dot products
// (vpdpbusd: u8 x s8 summed four at a time into int32), scaled per block in fp32.
//
//   Q4 (GGUF Q4_0/Q4_1 planes, group 32, fp16 d and m):  sum_j (d q_j + m) dx x_j
//        = d dx dot(q, xq) + m dx sum(xq)          (codes q are unsigned: vpdpbusd as is)
//   Q8 (GGUF Q8_0, fp16 d):  d dx dot(w, xq), w signed: (w ^ 0x80) = w + 128 as u8, and the
//        accumulator starts at -128 * (sum of the 8 xq its lane meets): the int32 dot is exact.
//
// The only error against the fp32 kernel is x's rounding to int8 (the weights are used as
// stored); kernels/qgemv_i8.py's `ref_q4_linear_i8` / `ref_q8_linear_i8` are the twins.
// With limbs = 2, x is held as two int8 limbs per block: the first as above, the second the
// rounding residual r = x - dx xq quantized the same way (dx2 = amax(r) / 127 <= dx / 254), so
// x is carried to ~1.6e-5 of its block's amax instead of ~4e-3; every dot runs twice over the
// weights unpacked once.
// x's quantized copy is laid out for the weights it meets (kernel-private, rebuilt per call):
// per quad of blocks, 128 bytes, the first halves (weights 0..15) of the 4 blocks, then their
// second halves. Q4 weights need only a mask (low nibbles = first halves) and a shift + mask
// (high nibbles) of one 64-byte load to meet it; Q8 weights two 8-byte-lane permutes of two
// loads. Lane l of each int32 dot then belongs to block 4 u + l / 4, four lanes a block, so
// one float convert + scale serves 4 blocks.
// Built only where the compiler targets AVX-512 VNNI; `int8_kernels()` says whether it did.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "blocks.h"
#include "chunks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TESSERA_I8 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera {
namespace {

void check_i8_shapes(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& out, int64_t K) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
  TORCH_CHECK(K % kBlock == 0, "in_features ", K, " is not a multiple of 32");
  const int64_t N = qs.size(0), M = x.size(0);
  TORCH_CHECK(d.dtype() == at::kHalf && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == K / kBlock && d.is_contiguous(),
              "scales must be contiguous float16 [", N, ", ", K / kBlock, "]");
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out must be a contiguous float32 [", M, ", ", N, "] tensor");
}

#ifdef TESSERA_I8
// x quantized for both weight kinds, in one layout: per quad of blocks, 128 bytes, the first
// halves (weights 0..15) of the 4 blocks, then their second halves, so that two 64-byte
// operands meet 4 weight blocks and lane l of the int32 dot belongs to block 4 u + l / 4.
// Rows are padded to whole quads (and `sx` to chunks of 16 blocks) with zeros: padding
// multiplies nothing, its int8 values and scales being 0.
struct QuantX {
  int64_t nb = 0, quads = 0, chunks = 0;  // per row: blocks, quads, chunks of 16 blocks
  std::vector<int8_t> q, q2;   // [M, quads * 128] (q2: the second limb, when limbs == 2)
  std::vector<float> dxe, dxe2;  // [M, quads * 16]: each dot lane's block dx (dx2)
  std::vector<float> sx;       // Q4: [M, chunks * 16] dx * sum(xq) (+ dx2 * sum(xq2)) per block
  std::vector<int32_t> corr, corr2;  // Q8: [M, quads * 16] -128 * sum of the 8 xq a lane meets
  int64_t q_stride() const { return quads * 128; }
  int64_t lane_stride() const { return quads * 16; }
  int64_t sx_stride() const { return chunks * 16; }
};

// Quantize one block of 32 floats into xq (natural order) and return dx; 127 / amax as the
// twin computes it, products rounded half to even (the default MXCSR mode).
inline float quantize_block(const float* x, int8_t* xq) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (!(amax > 0.0f)) {
    std::fill(xq, xq + kBlock, 0);
    return 0.0f;
  }
  const __m512 id = _mm512_set1_ps(127.0f / amax);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtsepi32_epi8(qb));
  return amax / 127.0f;
}

// The residual of a quantized block, r = x - dx * xq, each element rounded once (fnmadd).
inline void block_residual(const float* x, const int8_t* xq, float dx, float* r) {
  const __m512 d = _mm512_set1_ps(dx);
  for (int h = 0; h < 2; ++h) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16 * h))));
    _mm512_storeu_ps(r + 16 * h, _mm512_fnmadd_ps(d, q, _mm512_loadu_ps(x + 16 * h)));
  }
}

// One limb's block into the quad layout, its lanes' dx, and its Q8 lane corrections.
inline int32_t place_block(const int8_t* blk, float dx, int64_t b, bool q8, int8_t* q,
                           float* dxe, int32_t* corr) {
  const int64_t quad = b / 4, bi = b % 4;
  std::copy(blk, blk + 16, q + quad * 128 + bi * 16);
  std::copy(blk + 16, blk + 32, q + quad * 128 + 64 + bi * 16);
  for (int l = 0; l < 4; ++l) dxe[b * 4 + l] = dx;
  if (q8) {
    for (int l = 0; l < 4; ++l) {
      int32_t s = 0;
      for (int j = 0; j < 4; ++j) s += blk[4 * l + j] + blk[16 + 4 * l + j];
      corr[b * 4 + l] = -128 * s;
    }
  }
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) sum += blk[j];
  return sum;
}

void quantize_x(const float* x, int64_t M, int64_t K, bool q8, int limbs, QuantX& out) {
  out.nb = K / kBlock;
  out.quads = (out.nb + 3) / 4;
  out.chunks = (out.nb + 15) / 16;
  const int64_t lanes = M * out.lane_stride();
  out.q.assign(M * out.q_stride(), 0);
  out.dxe.assign(lanes, 0.0f);
  out.q2.assign(limbs == 2 ? M * out.q_stride() : 0, 0);
  out.dxe2.assign(limbs == 2 ? lanes : 0, 0.0f);
  out.corr.assign(q8 ? lanes : 0, 0);
  out.corr2.assign(q8 && limbs == 2 ? lanes : 0, 0);
  out.sx.assign(q8 ? 0 : M * out.sx_stride(), 0.0f);
  int8_t blk[kBlock], blk2[kBlock];
  float residual[kBlock];
  for (int64_t i = 0; i < M; ++i) {
    const int64_t qi = i * out.q_stride(), li = i * out.lane_stride();
    for (int64_t b = 0; b < out.nb; ++b) {
      const float* xb = x + i * K + b * kBlock;
      const float dx = quantize_block(xb, blk);
      const int32_t sum = place_block(blk, dx, b, q8, out.q.data() + qi, out.dxe.data() + li,
                                      q8 ? out.corr.data() + li : nullptr);
      float sx = dx * static_cast<float>(sum);
      if (limbs == 2) {
        block_residual(xb, blk, dx, residual);
        const float dx2 = quantize_block(residual, blk2);
        const int32_t sum2 =
            place_block(blk2, dx2, b, q8, out.q2.data() + qi, out.dxe2.data() + li,
                        q8 ? out.corr2.data() + li : nullptr);
        sx += dx2 * static_cast<float>(sum2);
      }
      if (!q8) out.sx[i * out.sx_stride() + b] = sx;
    }
  }
}

inline __m512 load_f16x16(const c10::Half* p, int n) {
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

inline __m512i load_bytes(const void* p, int64_t n) {  // n <= 64 bytes, the rest zero
  if (n >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((1ULL << n) - 1, p);
}

// Q4 planes: a quad of weight blocks is 64 contiguous bytes; low nibbles are the blocks'
// first halves, high nibbles their second halves: x's layout as it is.
struct Q4Planes {
  static constexpr bool kQ8 = false;
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  int64_t nb;
  void quad(int64_t n, int64_t b, __m512i& lo, __m512i& hi) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i v = load_bytes(qs + (n * nb + b) * 16, std::min<int64_t>(4, nb - b) * 16);
    lo = _mm512_and_si512(v, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
};

// Q8 planes: a quad is 128 bytes; its blocks' first and second halves are gathered by
// 8-byte lanes into two vectors, and flipped to unsigned (w + 128) for vpdpbusd.
struct Q8Planes {
  static constexpr bool kQ8 = true;
  const int8_t* qs;
  const c10::Half* d;
  const c10::Half* m;  // unused
  int64_t nb;
  void quad(int64_t n, int64_t b, __m512i& lo, __m512i& hi) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i first = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    const int64_t bytes = std::min<int64_t>(4, nb - b) * kBlock;
    const int8_t* p = qs + (n * nb + b) * kBlock;
    const __m512i v0 = load_bytes(p, std::min<int64_t>(64, bytes));
    const __m512i v1 = bytes > 64 ? load_bytes(p + 64, bytes - 64) : _mm512_setzero_si512();
    lo = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, first, v1), flip);
    hi = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, second, v1), flip);
  }
};

// MR rows of x from i0 against NR weight rows from n0: y[i, n]; L limbs of x.
template <typename W, int MR, int NR, int L>
void tile(const W& w, const QuantX& x, int64_t i0, int64_t n0, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t nb = w.nb;
  for (int64_t c = 0; c < x.chunks; ++c) {
    const int64_t b0 = c * 16;
    const int cb = static_cast<int>(std::min<int64_t>(16, nb - b0));
    __m512 dw[NR];
    for (int r = 0; r < NR; ++r) {
      const int64_t row = (n0 + r) * nb + b0;
      dw[r] = load_f16x16(w.d + row, cb);
      if constexpr (!W::kQ8) {  // the offsets' term: m dx sum(xq) per block
        const __m512 mv = load_f16x16(w.m + row, cb);
        for (int i = 0; i < MR; ++i)
          acc[i][r] = _mm512_fmadd_ps(
              mv, _mm512_loadu_ps(x.sx.data() + (i0 + i) * x.sx_stride() + b0), acc[i][r]);
      }
    }
    for (int u = 0; u * 4 < cb; ++u) {
      const int64_t b = b0 + 4 * u;
      const __m512i idx = _mm512_add_epi32(
          _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
          _mm512_set1_epi32(4 * u));
      __m512i lo[NR], hi[NR];
      __m512 dwe[NR];
      for (int r = 0; r < NR; ++r) {
        w.quad(n0 + r, b, lo[r], hi[r]);
        dwe[r] = _mm512_permutexvar_ps(idx, dw[r]);
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = x.q.data() + (i0 + i) * x.q_stride() + b * 32;
        const __m512i xl = _mm512_loadu_si512(xq), xh = _mm512_loadu_si512(xq + 64);
        const int64_t lane = (i0 + i) * x.lane_stride() + b * 4;
        const __m512 dxe = _mm512_loadu_ps(x.dxe.data() + lane);
        __m512i start = _mm512_setzero_si512(), start2 = _mm512_setzero_si512();
        if constexpr (W::kQ8) start = _mm512_loadu_si512(x.corr.data() + lane);
        __m512i xl2 = xl, xh2 = xh;
        __m512 dxe2 = dxe;
        if constexpr (L == 2) {
          const int8_t* xq2 = x.q2.data() + (i0 + i) * x.q_stride() + b * 32;
          xl2 = _mm512_loadu_si512(xq2);
          xh2 = _mm512_loadu_si512(xq2 + 64);
          dxe2 = _mm512_loadu_ps(x.dxe2.data() + lane);
          if constexpr (W::kQ8) start2 = _mm512_loadu_si512(x.corr2.data() + lane);
        }
        for (int r = 0; r < NR; ++r) {
          const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo[r], xl), hi[r], xh);
          __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dxe);
          if constexpr (L == 2) {
            const __m512i s2 =
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start2, lo[r], xl2), hi[r], xh2);
            v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), dxe2, v);
          }
          acc[i][r] = _mm512_fmadd_ps(v, dwe[r], acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[(i0 + i) * ldy + n0 + r] = _mm512_reduce_add_ps(acc[i][r]);
}

template <typename W, int MR, int NR, int L>
void rows_tile(const W& w, const QuantX& x, int64_t i0, int64_t n_begin, int64_t n_end,
               float* y, int64_t ldy) {
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) tile<W, MR, NR, L>(w, x, i0, n, y, ldy);
  for (; n < n_end; ++n) tile<W, MR, 1, L>(w, x, i0, n, y, ldy);
}

template <typename W, int L>
void gemm_i8(const W& w, const QuantX& x, int64_t M, int64_t N, int64_t K, float* y) {
  // ~32 KiB of weight bytes per task at least: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  // 48 weight rows per task a thread takes (chunks.h): a multiple of every tile's NR.
  parallel_chunks(N, 48, grain, [&](int64_t begin, int64_t end) {
    constexpr int64_t kRowChunk = 16;  // weight rows outer (kept in L1/L2), x rows inner
    for (int64_t n0 = begin; n0 < end; n0 += kRowChunk) {
      const int64_t n1 = std::min(end, n0 + kRowChunk);
      int64_t i = 0;
      for (; i + 4 <= M; i += 4) rows_tile<W, 4, 3, L>(w, x, i, n0, n1, y, N);
      if (M - i >= 2) { rows_tile<W, 2, 4, L>(w, x, i, n0, n1, y, N); i += 2; }
      if (M - i >= 1) { rows_tile<W, 1, 4, L>(w, x, i, n0, n1, y, N); i += 1; }
    }
  });
}

template <typename W>
void gemm_limbs(const W& w, const float* x, int64_t M, int64_t N, int64_t K, bool q8,
                int64_t limbs, float* y) {
  thread_local QuantX xq;
  quantize_x(x, M, K, q8, static_cast<int>(limbs), xq);
  if (limbs == 2) {
    gemm_i8<W, 2>(w, xq, M, N, K, y);
  } else {
    gemm_i8<W, 1>(w, xq, M, N, K, y);
  }
}
#endif  // TESSERA_I8

}  // namespace

bool int8_kernels() {
#ifdef TESSERA_I8
  return true;
#else
  return false;
#endif
}

// Every element of `out` is written (the tests poison it first).
void q4_linear_i8_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m, at::Tensor out,
                      int64_t limbs) {
  TORCH_CHECK(qs.dtype() == at::kByte && qs.dim() == 2 && qs.is_contiguous(),
              "qs must be a contiguous 2-d uint8 tensor");
  const int64_t K = qs.size(1) * 2, N = qs.size(0), M = x.size(0);
  check_i8_shapes(x, qs, d, out, K);
  TORCH_CHECK(m.dtype() == at::kHalf && m.sizes() == d.sizes() && m.is_contiguous(),
              "offsets must be contiguous float16 of the scales' shape");
  TORCH_CHECK(int8_kernels(), "int8 kernels are not built for this CPU (no AVX-512 VNNI)");
  TORCH_CHECK(limbs == 1 || limbs == 2, "limbs must be 1 or 2, got ", limbs);
#ifdef TESSERA_I8
  if (M == 0 || N == 0) return;
  const Q4Planes w{qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(),
                   K / kBlock};
  gemm_limbs(w, x.data_ptr<float>(), M, N, K, false, limbs, out.data_ptr<float>());
#endif
}

void q8_linear_i8_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out,
                      int64_t limbs) {
  TORCH_CHECK(qs.dtype() == at::kChar && qs.dim() == 2 && qs.is_contiguous(),
              "qs must be a contiguous 2-d int8 tensor");
  const int64_t K = qs.size(1), N = qs.size(0), M = x.size(0);
  check_i8_shapes(x, qs, d, out, K);
  TORCH_CHECK(int8_kernels(), "int8 kernels are not built for this CPU (no AVX-512 VNNI)");
  TORCH_CHECK(limbs == 1 || limbs == 2, "limbs must be 1 or 2, got ", limbs);
#ifdef TESSERA_I8
  if (M == 0 || N == 0) return;
  const Q8Planes w{qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), nullptr, K / kBlock};
  gemm_limbs(w, x.data_ptr<float>(), M, N, K, true, limbs, out.data_ptr<float>());
#endif
}

}  // namespace tessera
