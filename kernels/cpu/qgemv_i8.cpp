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
// Register tiles in oneDNN's style, one numeric path at every row count (batch invariance):
// x is quantized once per call; 16 weight rows at a time are unpacked once into a panel (L1),
// transposed so that lane r of a vector holds 4 u8 weights of row r, and every row of x meets
// it in tiles of 8, 4, 2 or 1 rows (its 4-byte groups broadcast to all lanes), so each int32
// lane sums a whole block of one output. Each output then takes the same float steps per block,
// in block order, whatever the tile, the row's place or the row count (see `tile`); threads
// split the weight rows only.
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
// x quantized once per call, block-major so that one block of a tile's rows is one stretch of
// memory: per block, per row, per limb 32 int8 in natural order; per block and row its dx,
// Q8's correction -128 sum(xq) (the weights meet vpdpbusd as w + 128) and Q4's offset factor
// sx = dx sum(xq) (+ dx2 sum(xq2)).
struct QuantX {
  int64_t nb = 0, M = 0, L = 1;
  std::vector<int8_t> q;         // [nb, M, L, 32]
  std::vector<float> dx[2];      // [nb, M] per limb
  std::vector<int32_t> corr[2];  // Q8: [nb, M] per limb
  std::vector<float> sx;         // Q4: [nb, M]
  const int8_t* block(int64_t b, int64_t i) const { return q.data() + (b * M + i) * L * kBlock; }
};

// Quantize one block of 32 floats (a, b) into xq (natural order); returns dx, sets *sum to the
// codes' sum and c[0..1] to the codes as int32. 127 / amax as the twin computes it, products
// rounded half to even (the default MXCSR mode). The codes stay in registers clamped as the
// int8 store saturates them (a no-op but for non-finite x), for the sum and the residual.
inline float quantize_block(__m512 a, __m512 b, int8_t* xq, int32_t* sum, __m512i c[2]) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (!(amax > 0.0f)) {
    std::fill(xq, xq + kBlock, 0);
    *sum = 0;
    c[0] = c[1] = _mm512_setzero_si512();
    return 0.0f;
  }
  const __m512 id = _mm512_set1_ps(127.0f / amax);
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  c[0] = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), hi), lo);
  c[1] = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, id)), hi), lo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(c[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(c[1]));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c[0], c[1]));
  return amax / 127.0f;
}

// Rows of x are quantized independently, so threads split them (past ~256 blocks: a decode
// row or a few stay on the calling thread) and the codes are the same however they split.
void quantize_x(const float* x, int64_t M, int64_t K, bool q8, int limbs, QuantX& out) {
  const int64_t nb = K / kBlock;
  out.nb = nb;
  out.M = M;
  out.L = limbs;
  out.q.resize(nb * M * limbs * kBlock);
  for (int l = 0; l < limbs; ++l) {
    out.dx[l].resize(M * nb);
    if (q8) out.corr[l].resize(M * nb);
  }
  if (!q8) out.sx.resize(M * nb);
  const auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t s = b * M + i;
        const float* xb = x + i * K + b * kBlock;
        int8_t* q = out.q.data() + s * limbs * kBlock;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        __m512i c[2];
        int32_t sum = 0;
        const float dx = quantize_block(x0, x1, q, &sum, c);
        out.dx[0][s] = dx;
        if (q8) out.corr[0][s] = -128 * sum;
        float sx = dx * static_cast<float>(sum);
        if (limbs == 2) {  // the residual r = x - dx xq, each element rounded once (fnmadd)
          const __m512 d = _mm512_set1_ps(dx);
          const __m512 r0 = _mm512_fnmadd_ps(d, _mm512_cvtepi32_ps(c[0]), x0);
          const __m512 r1 = _mm512_fnmadd_ps(d, _mm512_cvtepi32_ps(c[1]), x1);
          int32_t sum2 = 0;
          const float dx2 = quantize_block(r0, r1, q + kBlock, &sum2, c);
          out.dx[1][s] = dx2;
          if (q8) out.corr[1][s] = -128 * sum2;
          // NOTE: fused, spelled out: the compiler's contraction choice would otherwise change
          // these bits with the code around them.
          sx = std::fma(dx2, static_cast<float>(sum2), sx);
        }
        if (!q8) out.sx[s] = sx;
      }
    }
  };
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(nb, 1));
  if (M <= grain || at::in_parallel_region()) {
    rows(0, M);
  } else {
    at::parallel_for(0, M, grain, rows);
  }
}

inline __m512 load_f16x16(const c10::Half* p, int64_t n) {
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

inline __m512i load_bytes(const void* p, int64_t n) {  // n <= 64 bytes, the rest zero
  if (n >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((1ULL << n) - 1, p);
}

// In place: lane r of v[c] <- lane c of v[r] (16 x 16 dwords).
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // v[4i + k], 128-bit lane q: rows 4i..4i+3 of column 4q + k
    v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(v[k], v[4 + k], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0x44);
    const __m512i c = _mm512_shuffle_i32x4(v[k], v[4 + k], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(a, b, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(a, b, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(c, e, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(c, e, 0xDD);
  }
  for (int c = 0; c < 16; ++c) v[c] = t[c];
}

// kLanes weight rows unpacked once for every row of x: lane r of each vector is row n0 + r.
constexpr int kLanes = 16;
struct Panel {
  std::vector<int32_t> w;   // [nb][8][16]: dword j of block b, 4 u8 weights (Q8: w + 128)
  std::vector<float> d, m;  // [nb][16]: the blocks' scales (Q4: offsets)
  // What `tile` reads: the vectors above, or panel-major planes where they already hold it.
  const int32_t* wp = nullptr;
  const float* dp = nullptr;
  const float* mp = nullptr;
};

// Scales [N, nb] fp16 of rows n0.. (nr of them) into dst [nb][16] float.
inline void panel_scales(const c10::Half* s, int64_t nb, int64_t n0, int nr, float* dst) {
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t cb = std::min<int64_t>(16, nb - b0);
    __m512i v[16];
    for (int r = 0; r < 16; ++r)
      v[r] = r < nr ? _mm512_castps_si512(load_f16x16(s + (n0 + r) * nb + b0, cb))
                    : _mm512_setzero_si512();
    transpose16(v);
    for (int64_t c = 0; c < cb; ++c) _mm512_storeu_si512(dst + (b0 + c) * kLanes, v[c]);
  }
}

// Q4 planes: a row's quad of blocks is 64 contiguous bytes (16 a block; byte j holds weight j
// in its low nibble, weight j + 16 in its high one).
struct Q4Planes {
  static constexpr bool kQ8 = false;
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  int64_t nb;
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(qs + n * nb * 16); }
  int64_t row_bytes() const { return nb * 16; }
  void unpack(int64_t n0, int nr, Panel& p) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
      const int64_t bytes = std::min<int64_t>(4, nb - b0) * 16;
      __m512i v[16];
      for (int r = 0; r < 16; ++r)
        v[r] = r < nr ? load_bytes(qs + ((n0 + r) * nb + b0) * 16, bytes) : _mm512_setzero_si512();
      transpose16(v);  // v[c]: dword c % 4 of block b0 + c / 4
      for (int c = 0; c < 16 && b0 + c / 4 < nb; ++c) {
        int32_t* dst = p.w.data() + ((b0 + c / 4) * 8 + c % 4) * kLanes;
        _mm512_storeu_si512(dst, _mm512_and_si512(v[c], low4));
        _mm512_storeu_si512(dst + 4 * kLanes, _mm512_and_si512(_mm512_srli_epi16(v[c], 4), low4));
      }
    }
    panel_scales(d, nb, n0, nr, p.d.data());
    panel_scales(m, nb, n0, nr, p.m.data());
    p.wp = p.w.data();
    p.dp = p.d.data();
    p.mp = p.m.data();
  }
};

// Q8 planes: a row's pair of blocks is 64 contiguous bytes, flipped to unsigned (w + 128).
struct Q8Planes {
  static constexpr bool kQ8 = true;
  const int8_t* qs;
  const c10::Half* d;
  const c10::Half* m;  // unused
  int64_t nb;
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(qs + n * nb * kBlock); }
  int64_t row_bytes() const { return nb * kBlock; }
  void unpack(int64_t n0, int nr, Panel& p) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
      const int64_t bytes = std::min<int64_t>(2, nb - b0) * kBlock;
      __m512i v[16];
      for (int r = 0; r < 16; ++r)
        v[r] = r < nr ? load_bytes(qs + ((n0 + r) * nb + b0) * kBlock, bytes)
                      : _mm512_setzero_si512();
      transpose16(v);  // v[c]: dword c % 8 of block b0 + c / 8
      for (int c = 0; c < 16 && b0 + c / 8 < nb; ++c)
        _mm512_storeu_si512(p.w.data() + ((b0 + c / 8) * 8 + c % 8) * kLanes,
                            _mm512_xor_si512(v[c], flip));
    }
    panel_scales(d, nb, n0, nr, p.d.data());
    p.wp = p.w.data();
    p.dp = p.d.data();
  }
};

// Panel-major planes (kernels/block_panels.py lays them out at load): each 16-row panel
// already in the transposed form `unpack` above builds, so Q8 is read in place and Q4 only
// has its nibbles split. N is whole panels (nr is always 16).
template <bool Q8>
struct PanelPlanes {
  static constexpr bool kQ8 = Q8;
  static constexpr int64_t kBlockBytes = Q8 ? 512 : 256;  // one block of a panel as stored
  const uint8_t* pw;
  const float* pd;
  const float* pm;  // Q4 only
  int64_t nb;
  const char* row(int64_t n) const {  // n a multiple of 16: where its panel starts
    return reinterpret_cast<const char*>(pw + n / kLanes * nb * kBlockBytes);
  }
  int64_t row_bytes() const { return nb * kBlockBytes / kLanes; }
  void unpack(int64_t n0, int /*nr*/, Panel& p) const {
    const int64_t panel = n0 / kLanes;
    const uint8_t* src = pw + panel * nb * kBlockBytes;
    if constexpr (Q8) {
      p.wp = reinterpret_cast<const int32_t*>(src);
    } else {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(src + b * kBlockBytes + c * 64);
          int32_t* dst = p.w.data() + (b * 8 + c) * kLanes;
          _mm512_storeu_si512(dst, _mm512_and_si512(v, low4));
          _mm512_storeu_si512(dst + 4 * kLanes,
                              _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        }
      p.wp = p.w.data();
      p.mp = pm + panel * nb * kLanes;
    }
    p.dp = pd + panel * nb * kLanes;
  }
};

// acc += dot(w's u8 quads, the s8 quad at p broadcast to every lane). The broadcast is the
// instruction's memory operand (GCC emits a separate vpbroadcastd, which costs a vector slot).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// MR rows of x from i0 against the panel's rows: y[i, n0 + r] for r < nr. Every output is
// acc = 0, then per block b in order: (Q4) acc = fma(m, sx, acc); v = float(dot1) * dx1;
// (two limbs) v = fma(float(dot2), dx2, v); acc = fma(v, d, acc): exact integer dots and the
// same float operations whatever MR, the row's place or the call's row count.
template <bool kQ8, int MR, int L>
void tile(const Panel& p, const QuantX& x, int64_t i0, int64_t n0, int nr, float* y,
          int64_t ldy) {
  const int64_t nb = x.nb, M = x.M;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = b * M + i0;
    __m512i s[L][MR];
    for (int l = 0; l < L; ++l)
      for (int i = 0; i < MR; ++i) s[l][i] = _mm512_setzero_si512();
    const int32_t* wb = p.wp + b * 8 * kLanes;
    const int8_t* xb = x.block(b, i0);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(wb + j * kLanes);
      for (int i = 0; i < MR; ++i)
        for (int l = 0; l < L; ++l)
          s[l][i] = dpbusd_bcast(s[l][i], w, xb + (i * L + l) * kBlock + 4 * j);
    }
    if constexpr (kQ8)  // integers: where the correction joins the dot changes no bit
      for (int l = 0; l < L; ++l)
        for (int i = 0; i < MR; ++i)
          s[l][i] = _mm512_add_epi32(s[l][i], _mm512_set1_epi32(x.corr[l][e + i]));
    const __m512 dv = _mm512_loadu_ps(p.dp + b * kLanes);
    for (int i = 0; i < MR; ++i) {
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s[0][i]), _mm512_set1_ps(x.dx[0][e + i]));
      if constexpr (L == 2)
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1][i]), _mm512_set1_ps(x.dx[1][e + i]), v);
      if constexpr (!kQ8)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(p.mp + b * kLanes),
                                 _mm512_set1_ps(x.sx[e + i]), acc[i]);
      acc[i] = _mm512_fmadd_ps(v, dv, acc[i]);
    }
  }
  const __mmask16 mask = nr >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (i0 + i) * ldy + n0, mask, acc[i]);
}

template <typename W, int L>
void gemm_i8(const W& w, const QuantX& x, int64_t M, int64_t N, int64_t K, float* y) {
  // ~32 KiB of weight bytes per task at least: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  // Weight rows per task a thread takes (chunks.h): whole panels but for N's last; four
  // panels at a time for a few rows of x (the next panel's weights prefetched), one at a time
  // from 16 rows (a panel is then long work, and the model's N = 576 splits evenly in two).
  const int64_t chunk = M >= 16 ? kLanes : 4 * kLanes;
  parallel_chunks(N, chunk, grain, [&](int64_t begin, int64_t end) {
    thread_local Panel panel;
    panel.w.resize(w.nb * 8 * kLanes);
    panel.d.resize(w.nb * kLanes);
    if (!W::kQ8) panel.m.resize(w.nb * kLanes);
    for (int64_t n0 = begin; n0 < end; n0 += kLanes) {
      const int nr = static_cast<int>(std::min<int64_t>(kLanes, end - n0));
      w.unpack(n0, nr, panel);
      if (n0 + kLanes < end) {  // the next panel's weights into L2 while this one computes
        const char* next = w.row(n0 + kLanes);
        const int64_t bytes = std::min<int64_t>(kLanes, end - n0 - kLanes) * w.row_bytes();
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
      }
      int64_t i = 0;
      for (; i + 8 <= M; i += 8) tile<W::kQ8, 8, L>(panel, x, i, n0, nr, y, N);
      if (M - i >= 4) { tile<W::kQ8, 4, L>(panel, x, i, n0, nr, y, N); i += 4; }
      if (M - i >= 2) { tile<W::kQ8, 2, L>(panel, x, i, n0, nr, y, N); i += 2; }
      if (M - i >= 1) { tile<W::kQ8, 1, L>(panel, x, i, n0, nr, y, N); i += 1; }
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

// x [M, K] float32 over panel-major planes (kernels/block_panels.py): pw uint8 [P, nb, 256]
// (Q4, with pm) or [P, nb, 512] (Q8), pd and pm float32 [P, nb, 16]; out [M, 16 P].
void block_panels_linear_out(at::Tensor x, at::Tensor pw, at::Tensor pd,
                             c10::optional<at::Tensor> pm, int64_t limbs, at::Tensor out) {
  TORCH_CHECK(pw.dtype() == at::kByte && pw.dim() == 3 && pw.is_contiguous() &&
                  (pw.size(2) == 256 || pw.size(2) == 512),
              "panels must be contiguous uint8 [P, nb, 256 (Q4) or 512 (Q8)]");
  const bool q8 = pw.size(2) == 512;
  const int64_t P = pw.size(0), nb = pw.size(1), K = nb * kBlock, N = P * kLanes;
  const auto check_scales = [&](const at::Tensor& s, const char* what) {
    TORCH_CHECK(s.dtype() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                    s.size(0) == P && s.size(1) == nb && s.size(2) == kLanes,
                what, " must be contiguous float32 [", P, ", ", nb, ", 16]");
  };
  check_scales(pd, "panel scales");
  TORCH_CHECK(q8 != pm.has_value(), "Q4 panels need their offsets (pm), Q8 panels take none");
  if (pm.has_value()) check_scales(*pm, "panel offsets");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, ", K, "] tensor");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dtype() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out must be a contiguous float32 [", M, ", ", N, "] tensor");
  TORCH_CHECK(int8_kernels(), "int8 kernels are not built for this CPU (no AVX-512 VNNI)");
  TORCH_CHECK(limbs == 1 || limbs == 2, "limbs must be 1 or 2, got ", limbs);
#ifdef TESSERA_I8
  if (M == 0 || N == 0) return;
  const uint8_t* w = pw.data_ptr<uint8_t>();
  if (q8) {
    gemm_limbs(PanelPlanes<true>{w, pd.data_ptr<float>(), nullptr, nb}, x.data_ptr<float>(), M,
               N, K, true, limbs, out.data_ptr<float>());
  } else {
    gemm_limbs(PanelPlanes<false>{w, pd.data_ptr<float>(), pm->data_ptr<float>(), nb},
               x.data_ptr<float>(), M, N, K, false, limbs, out.data_ptr<float>());
  }
#endif
}

}  // namespace tessera
