// The CPU kernels of the `tessera` ops (schemas: kernels/ops.py), registered in ops.cpp and
// called by the fused decode step (decode_llama.cpp); each is defined in its own file.
#pragma once

#include <ATen/ATen.h>

namespace tessera {
at::Tensor gather_e4m3_rows(at::Tensor flat, at::Tensor rows);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor page_table, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale,
                                  c10::optional<at::Tensor> v_scale, bool hadamard,
                                  c10::optional<at::Tensor> q_scale,
                                  c10::optional<at::Tensor> out_scale);
void store_kv_rows(at::Tensor x, at::Tensor cache, at::Tensor slots,
                   c10::optional<at::Tensor> scale, bool hadamard,
                   c10::optional<at::Tensor> shift, c10::optional<at::Tensor> divisor);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight,
                        double eps);
void q4_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                   c10::optional<at::Tensor> zeros, int64_t group_size, at::Tensor out);
void q8_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out);
void q4_linear_i8_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m, at::Tensor out,
                      int64_t limbs);
void q8_linear_i8_out(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor out,
                      int64_t limbs);
at::Tensor q4_dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                         c10::optional<at::Tensor> zeros, int64_t group_size);
at::Tensor q8_dequantize(at::Tensor qs, at::Tensor d);
void block_linear_out(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> zeros, int64_t group_size, int64_t limbs,
                      at::Tensor out);
void block_panels_linear_out(at::Tensor x, at::Tensor pw, at::Tensor pd,
                             c10::optional<at::Tensor> pm, int64_t limbs, at::Tensor out);
void bf16_linear_out(at::Tensor x, at::Tensor w, at::Tensor out);
bool bf16_gemm_available();
bool int8_kernels();
}  // namespace tessera
