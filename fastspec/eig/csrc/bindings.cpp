// bindings.cpp — pybind11 module fastspec.eig._host: the host twin of the CUDA eigensolver and its
// team emulation. Raw pointers in, no torch, no numpy types: pointers are integers
// (tensor.data_ptr()), strides are in elements. The CUDA kernel itself is not in this module: it
// is compiled at run time by NVRTC (fastspec/eig/nvrtc.py). The module reports the limits it was
// compiled with (MAX_N, ...: the macros of fastspec/eig/limits.py), so Python can tell a stale build.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "eig_core.h"
#include "eig_host.h"

namespace py = pybind11;

namespace {

void check_problem(uintptr_t in, uintptr_t out, int64_t batch, int n) {
  if (batch < 0) throw std::invalid_argument("batch: must be >= 0, got " + std::to_string(batch));
  if (n < 1 || n > fastspec::kMaxN)
    throw std::invalid_argument("n: must be in [1, " + std::to_string(fastspec::kMaxN) + "], got " +
                                std::to_string(n));
  if (batch > 0 && (in == 0 || out == 0)) throw std::invalid_argument("in/out: null pointer");
}

template <class Real, void (*F)(const Real*, Real*, int64_t, int, int64_t, int64_t, int64_t, int64_t)>
void host_entry(uintptr_t in, uintptr_t out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  check_problem(in, out, batch, n);
  py::gil_scoped_release release;
  F(reinterpret_cast<const Real*>(in), reinterpret_cast<Real*>(out), batch, n, sb, sr, sc, osb);
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "fastspec batched symmetric eigenvalues (eigenvalues only, ascending; lower triangle read)";
  // what this build was compiled with (fastspec/eig/limits.py's MACROS): native.py compares them
  m.attr("MAX_N") = fastspec::kMaxN;
  m.attr("MAX_THREADS") = fastspec::kMaxThreads;
  m.attr("GRID") = fastspec::kGrid;
  m.attr("SCRATCH") = fastspec::kScratch;
  const char* host_doc =
      "(in_ptr, out_ptr, batch, n, stride_batch, stride_row, stride_col, out_stride_batch): host twin of the CUDA "
      "solver on host memory; strides in elements; out rows contiguous.";
  m.def("host_eigvalsh_f32", &host_entry<float, fastspec::host_eigvalsh_f32>, host_doc);
  m.def("host_eigvalsh_f64", &host_entry<double, fastspec::host_eigvalsh_f64>, host_doc);
  const char* team_doc =
      "(in_ptr, out_ptr, batch, n, stride_batch, stride_row, stride_col, out_stride_batch): tests only; the CUDA "
      "kernel's parallel algorithm run by host threads (one per column, the kernel's barriers, reduction order and "
      "shared-memory layout). Slow.";
  m.def("team_eigvalsh_f32", &host_entry<float, fastspec::team_eigvalsh_f32>, team_doc);
  m.def("team_eigvalsh_f64", &host_entry<double, fastspec::team_eigvalsh_f64>, team_doc);
  m.def("block_work_elems", [](int n, bool matrix_here) { return fastspec::block_work_elems(n, matrix_here); },
        py::arg("n"), py::arg("matrix_here"),
        "reals of one CUDA block's work arrays (eig_core.h); tests check the launcher's copy of the formula");
}
