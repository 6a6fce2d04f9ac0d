// One step through every layer of a Llama-family decoder in one call: the ops of
// runtime/models/llama.py (LlamaDecoderLayer.forward over block weights and paged KV), the
// same kernels in the same order, with no Python between them. At one sequence the Python and
// dispatch between a step's ~700 small ops cost about as much as its matmuls (issue 16). Rows
// are decodes or prefill chunk tokens alike: each attends over its own page-table row and
// context length (runtime/attention/fused_decode.py `fused_rows`).
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <tuple>
#include <vector>

#include "blocks.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera {
namespace {

using OptTensor = c10::optional<at::Tensor>;
// (q8, int8 limbs of x (0: float32 x), qs, d, m, bias): a BlockLinear's planes
// (runtime/quant/blocks.py), or its panel-major planes (pw, pd, pm: kernels/block_panels.py),
// told apart by 3-d codes.
using ProjSpec = std::tuple<bool, int64_t, at::Tensor, at::Tensor, OptTensor, OptTensor>;
// (k, v, k_scale, v_scale, hadamard, k_shift, k_divisor, v_divisor): runtime.kv LayerKV.
using KVSpec = std::tuple<at::Tensor, at::Tensor, OptTensor, OptTensor, bool, OptTensor,
                          OptTensor, OptTensor>;

struct BlockProj {
  bool q8;
  int64_t limbs;
  at::Tensor qs, d;
  OptTensor m, bias;

  explicit BlockProj(const ProjSpec& s)
      : q8(std::get<0>(s)), limbs(std::get<1>(s)), qs(std::get<2>(s)), d(std::get<3>(s)),
        m(std::get<4>(s)), bias(std::get<5>(s)) {
    TORCH_CHECK(q8 || m.has_value(), "Q4 planes need their offsets (m)");
  }

  // x: [T, K] float32 contiguous -> [T, N], through the block linear's one choice of kernel,
  // which never depends on T (batch invariance: docs/DESIGN.md).
  at::Tensor operator()(const at::Tensor& x) const {
    if (qs.dim() == 3) {
      at::Tensor y = at::empty({x.size(0), qs.size(0) * 16}, x.options());
      block_panels_linear_out(x, qs, d, m, limbs, y);
      return bias.has_value() ? y.add_(*bias) : y;
    }
    at::Tensor y = at::empty({x.size(0), qs.size(0)}, x.options());
    block_linear_out(x, qs, d, m, c10::nullopt, kBlock, limbs, y);
    return bias.has_value() ? y.add_(*bias) : y;
  }
};

// The phases of a layer that `phase_ns` accounts for, in order.
enum Phase { kNorm, kQkv, kRope, kStoreKv, kAttention, kO, kGateUp, kSiluMul, kDown, kPhases };

// Adds the time since the last mark to a phase when profiling (one clock read a phase): wall
// time (mode 1), or the calling thread's CPU time (mode 2: exact at one thread whatever else
// the machine runs; with more threads it counts only the caller's share).
class PhaseClock {
 public:
  PhaseClock(int64_t mode, std::array<int64_t, kPhases>* totals) : mode_(mode), totals_(totals) {
    if (mode_) last_ = now();
  }
  void mark(Phase p) {
    if (!mode_) return;
    const int64_t t = now();
    (*totals_)[p] += t - last_;
    last_ = t;
  }

 private:
  int64_t now() const {
    if (mode_ == 2) {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
    }
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  int64_t mode_;
  std::array<int64_t, kPhases>* totals_;
  int64_t last_ = 0;
};

// Rotate-half RoPE in place over the first `heads` heads of each row of qkv [T, width]:
// x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin, each product and sum rounded on its
// own as torch's separate ops round them (explicit-rounding intrinsics: the compiler may not
// fuse them into FMAs), so the bits are RotaryEmbedding's. cos, sin: [T, half] contiguous.
// False where it does not apply (no AVX-512, half not a multiple of 16): the caller uses aten.
bool rope_inplace(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t heads, int64_t dim) {
#if defined(__AVX512F__)
  const int64_t half = dim / 2, T = qkv.size(0), width = qkv.size(1);
  if (half % 16 != 0 || !qkv.is_contiguous() || !cos.is_contiguous() || !sin.is_contiguous() ||
      cos.numel() != T * half || sin.numel() != T * half || cos.scalar_type() != at::kFloat ||
      sin.scalar_type() != at::kFloat)
    return false;
  constexpr int kR = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = base + t * width + h * dim;
      for (int64_t j = 0; j < half; j += 16) {
        const __m512 c = _mm512_loadu_ps(cp + t * half + j), s = _mm512_loadu_ps(sp + t * half + j);
        const __m512 x1 = _mm512_loadu_ps(x + j), x2 = _mm512_loadu_ps(x + half + j);
        _mm512_storeu_ps(x + j, _mm512_sub_round_ps(_mm512_mul_round_ps(x1, c, kR),
                                                    _mm512_mul_round_ps(x2, s, kR), kR));
        _mm512_storeu_ps(x + half + j, _mm512_add_round_ps(_mm512_mul_round_ps(x2, c, kR),
                                                           _mm512_mul_round_ps(x1, s, kR), kR));
      }
    }
  return true;
#else
  (void)qkv, (void)cos, (void)sin, (void)heads, (void)dim;
  return false;
#endif
}

struct Layer {
  at::Tensor input_norm, post_norm;
  BlockProj qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
  OptTensor k_scale, v_scale;
  bool hadamard;
  OptTensor k_shift, k_divisor, v_divisor;
};

}  // namespace

class LlamaDecode : public torch::CustomClassHolder {
 public:
  LlamaDecode(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(head_dim % 2 == 0 && heads % kv_heads == 0, "bad attention shape");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, ProjSpec qkv, ProjSpec o,
                 ProjSpec gate_up, ProjSpec down, KVSpec kv) {
    layers_.push_back(Layer{input_norm, post_norm, BlockProj(qkv), BlockProj(o),
                            BlockProj(gate_up), BlockProj(down), std::get<0>(kv), std::get<1>(kv),
                            std::get<2>(kv), std::get<3>(kv), std::get<4>(kv), std::get<5>(kv),
                            std::get<6>(kv), std::get<7>(kv)});
  }

  // x: [T, hidden] float32, the embedded tokens (updated in place: the residual stream);
  // cos, sin: [T, 1, head_dim / 2] at the tokens' positions; slots: [T] int64;
  // page_table: [T, max_pages] int64; context_lens: [T] int64. Returns the hidden states
  // [T, hidden] before the final norm (x itself).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slots, const at::Tensor& page_table,
                     const at::Tensor& context_lens) const {
    c10::InferenceMode guard;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "x must be a contiguous [tokens, hidden] float32 tensor");
    const int64_t T = x.size(0), D = head_dim_, half = D / 2;
    const int64_t q_size = heads_ * D, qk_size = q_size + kv_heads_ * D;
    OptTensor pending;
    PhaseClock clock(profiling_, &phase_ns_);
    for (const Layer& l : layers_) {
      at::Tensor h = add_rms_norm(x, pending, l.input_norm, eps_);
      clock.mark(kNorm);
      at::Tensor qkv = l.qkv(h);
      clock.mark(kQkv);
      // q and k heads are adjacent in qkv: rotated together (rotate-half), as RotaryEmbedding.
      at::Tensor qk = qkv.slice(1, 0, qk_size).view({T, heads_ + kv_heads_, D});
      if (!rope_inplace(qkv, cos, sin, heads_ + kv_heads_, D)) {
        const at::Tensor x1 = qk.slice(2, 0, half), x2 = qk.slice(2, half);
        qk = at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
      }
      const at::Tensor q = qk.slice(1, 0, heads_), k = qk.slice(1, heads_);
      const at::Tensor v = qkv.slice(1, qk_size).view({T, kv_heads_, D});
      clock.mark(kRope);
      store_kv_rows(k, l.k_cache, slots, l.k_scale, l.hadamard, l.k_shift, l.k_divisor);
      store_kv_rows(v, l.v_cache, slots, l.v_scale, l.hadamard, c10::nullopt, l.v_divisor);
      clock.mark(kStoreKv);
      const at::Tensor attn =
          paged_decode_attention(q, l.k_cache, l.v_cache, page_table, context_lens, scale_,
                                 l.k_scale, l.v_scale, l.hadamard, l.k_divisor, l.v_divisor);
      clock.mark(kAttention);
      const at::Tensor o = l.o(attn);
      clock.mark(kO);
      h = add_rms_norm(x, o, l.post_norm, eps_);
      clock.mark(kNorm);
      const at::Tensor gate_up = l.gate_up(h);
      clock.mark(kGateUp);
      const at::Tensor act = silu_mul(gate_up);
      clock.mark(kSiluMul);
      pending = l.down(act);
      clock.mark(kDown);
    }
    at::Tensor out = pending.has_value() ? x.add_(*pending) : x;
    clock.mark(kNorm);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Profiling (mode 0, off, by default; 1 wall time, 2 the calling thread's CPU time): each
  // phase's nanoseconds summed over every step since it was set, [kPhases] int64 in Phase
  // order (see kernels/decode_llama.py PHASES).
  void set_profiling(int64_t mode) {
    TORCH_CHECK(mode >= 0 && mode <= 2, "profiling mode must be 0, 1 or 2");
    profiling_ = mode;
    phase_ns_.fill(0);
  }
  at::Tensor phase_ns() const {
    at::Tensor t = at::empty({kPhases}, at::kLong);
    std::copy(phase_ns_.begin(), phase_ns_.end(), t.data_ptr<int64_t>());
    return t;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  int64_t profiling_ = 0;
  mutable std::array<int64_t, kPhases> phase_ns_{};
};

// x updated in place and returned: the op's schema says so (kernels/ops.py registers its fake).
at::Tensor llama_decode_step(const c10::intrusive_ptr<LlamaDecode>& step, at::Tensor x,
                             at::Tensor cos, at::Tensor sin, at::Tensor slots,
                             at::Tensor page_table, at::Tensor context_lens) {
  return step->forward(x, cos, sin, slots, page_table, context_lens);
}

}  // namespace tessera

// The fused step's state (weights and pages per layer) is a torch custom class, so the op that
// runs it can be declared only where this build exists: here, not in kernels/ops.py. Calls
// from Python release the GIL for the step (the worker's gRPC and asyncio threads run beside it).
TORCH_LIBRARY_FRAGMENT(tessera, m) {
  m.class_<tessera::LlamaDecode>("LlamaDecode")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &tessera::LlamaDecode::add_layer)
      .def("num_layers", &tessera::LlamaDecode::num_layers)
      .def("set_profiling", &tessera::LlamaDecode::set_profiling)
      .def("phase_ns", &tessera::LlamaDecode::phase_ns);
  m.def("llama_decode_step(__torch__.torch.classes.tessera.LlamaDecode step, Tensor(a!) x, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor page_table, Tensor context_lens) "
        "-> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) { m.impl("llama_decode_step", &tessera::llama_decode_step); }
