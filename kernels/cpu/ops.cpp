// The CPU ops module: bindings only (each op lives in its own file).
#include <torch/extension.h>

namespace tessera {
at::Tensor gather_e4m3_rows(at::Tensor flat, at::Tensor rows);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor page_table,
                                     at::Tensor context_lens, double scale,
                                     c10::optional<at::Tensor> k_scale,
                                     c10::optional<at::Tensor> v_scale, bool hadamard,
                                     c10::optional<at::Tensor> q_scale,
                                     c10::optional<at::Tensor> out_scale);
void store_kv_rows(at::Tensor x, at::Tensor cache, at::Tensor slots,
                   c10::optional<at::Tensor> scale, bool hadamard,
                   c10::optional<at::Tensor> shift, c10::optional<at::Tensor> divisor);
}  // namespace tessera

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_e4m3_rows", &tessera::gather_e4m3_rows);
  m.def("paged_decode_attention", &tessera::paged_decode_attention, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("context_lens"),
        py::arg("scale"), py::arg("k_scale"), py::arg("v_scale"), py::arg("hadamard") = false,
        py::arg("q_scale") = py::none(), py::arg("out_scale") = py::none());
  m.def("store_kv_rows", &tessera::store_kv_rows, py::arg("x"), py::arg("cache"),
        py::arg("slots"), py::arg("scale"), py::arg("hadamard") = false,
        py::arg("shift") = py::none(), py::arg("divisor") = py::none());
}
