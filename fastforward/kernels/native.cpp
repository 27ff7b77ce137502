// fastforward's native module: one extension, compiled on first use for the CPU at hand (see __init__.py).
// Each source registers its functions here.
#include <torch/csrc/utils/pybind.h>

#include "isa.h"

void register_skinny_gemm(pybind11::module& m);
void register_quant_gemm(pybind11::module& m);
void register_layer_ops(pybind11::module& m);
void register_amx_gemm(pybind11::module& m);
void register_q8_gemm(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_skinny_gemm(m);
  register_quant_gemm(m);
  register_layer_ops(m);
  register_amx_gemm(m);
  register_q8_gemm(m);
  m.attr("isa") = ff::kIsaName;
}
