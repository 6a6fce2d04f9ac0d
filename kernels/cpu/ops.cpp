// The CPU ops module: bindings only (each op lives in its own file).
#include <torch/extension.h>

namespace tessera {
torch::Tensor gather_e4m3_rows(torch::Tensor flat, torch::Tensor rows);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor page_table,
                                     torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale);
void store_kv_rows(torch::Tensor x, torch::Tensor cache, torch::Tensor slots,
                   c10::optional<torch::Tensor> scale);
}  // namespace tessera

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_e4m3_rows", &tessera::gather_e4m3_rows);
  m.def("paged_decode_attention", &tessera::paged_decode_attention);
  m.def("store_kv_rows", &tessera::store_kv_rows);
}
