// The CPU ops module: bindings only (each op lives in its own file).
#include <torch/extension.h>

#include "ops.h"

namespace tessera {
void bind_llama_decode(pybind11::module& m);
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
  tessera::bind_llama_decode(m);
}
