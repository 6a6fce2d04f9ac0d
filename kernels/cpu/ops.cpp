// The CPU implementations of the `tessera` torch ops. The ops themselves (schemas, fake
// implementations, the torch twins every other device runs until it has its own kernel) are
// declared once in kernels/ops.py; this file only registers each kernel under the CPU key.
// Ops that describe this build rather than compute (which SIMD paths it has) are declared here.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_FRAGMENT(tessera, m) {
  m.def("cpu_int8_kernels() -> bool", &tessera::int8_kernels);
  m.def("cpu_bf16_gemm() -> bool", &tessera::bf16_gemm_available);
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("gather_e4m3_rows", &tessera::gather_e4m3_rows);
  m.impl("paged_decode_attention", &tessera::paged_decode_attention);
  m.impl("store_kv_rows", &tessera::store_kv_rows);
  m.impl("add_rms_norm", &tessera::add_rms_norm);
  m.impl("silu_mul", &tessera::silu_mul);
  m.impl("q4_linear_out", &tessera::q4_linear_out);
  m.impl("q8_linear_out", &tessera::q8_linear_out);
  m.impl("q4_dequantize", &tessera::q4_dequantize);
  m.impl("q8_dequantize", &tessera::q8_dequantize);
  m.impl("q4_linear_i8_out", &tessera::q4_linear_i8_out);
  m.impl("q8_linear_i8_out", &tessera::q8_linear_i8_out);
  m.impl("block_linear_out", &tessera::block_linear_out);
  m.impl("block_panels_linear_out", &tessera::block_panels_linear_out);
  m.impl("bf16_linear_out", &tessera::bf16_linear_out);
}
