// bindings.cpp — pybind11 module fastspec._eig_ext: raw pointers in, no torch, no numpy types.
// Pointers are integers (tensor.data_ptr(), cupy's .data.ptr), strides are in elements, the
// stream is a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "eig_host.h"
#ifdef FASTSPEC_WITH_CUDA
#include "eig_cuda.h"
#endif

namespace py = pybind11;

namespace {

constexpr int kMaxNCuda = 1024;  // shared-memory vectors of the kernel (eig_cuda.cu) bound n

void check_problem(uintptr_t in, uintptr_t out, int64_t batch, int n, int max_n) {
  if (batch < 0) throw std::invalid_argument("batch: must be >= 0, got " + std::to_string(batch));
  if (n < 1 || n > max_n)
    throw std::invalid_argument("n: must be in [1, " + std::to_string(max_n) + "], got " + std::to_string(n));
  if (batch > 0 && (in == 0 || out == 0)) throw std::invalid_argument("in/out: null pointer");
}

template <class Real, void (*F)(const Real*, Real*, int64_t, int, int64_t, int64_t, int64_t, int64_t)>
void host_entry(uintptr_t in, uintptr_t out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  check_problem(in, out, batch, n, 1 << 16);
  py::gil_scoped_release release;
  F(reinterpret_cast<const Real*>(in), reinterpret_cast<Real*>(out), batch, n, sb, sr, sc, osb);
}

#ifdef FASTSPEC_WITH_CUDA
template <class Real,
          void (*F)(const Real*, Real*, Real*, int64_t, int, int64_t, int64_t, int64_t, int64_t, int, void*)>
void cuda_entry(uintptr_t in, uintptr_t out, uintptr_t work, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                int64_t osb, int device, uintptr_t stream) {
  check_problem(in, out, batch, n, kMaxNCuda);
  py::gil_scoped_release release;
  F(reinterpret_cast<const Real*>(in), reinterpret_cast<Real*>(out), reinterpret_cast<Real*>(work), batch, n, sb, sr,
    sc, osb, device, reinterpret_cast<void*>(stream));
}
#endif

}  // namespace

PYBIND11_MODULE(_eig_ext, m) {
  m.doc() = "fastspec batched symmetric eigenvalues (eigenvalues only, ascending; lower triangle read)";
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
#ifdef FASTSPEC_WITH_CUDA
  m.attr("has_cuda") = true;
  m.attr("max_n_cuda") = kMaxNCuda;
  const char* cuda_doc =
      "(in_ptr, out_ptr, work_ptr, batch, n, stride_batch, stride_row, stride_col, out_stride_batch, device, stream): "
      "one thread block per matrix, asynchronous on the stream; work_ptr may be 0 when cuda_workspace_elems is 0.";
  m.def("cuda_eigvalsh_f32", &cuda_entry<float, fastspec::cuda_eigvalsh_f32>, cuda_doc);
  m.def("cuda_eigvalsh_f64", &cuda_entry<double, fastspec::cuda_eigvalsh_f64>, cuda_doc);
  m.def("cuda_workspace_elems", &fastspec::cuda_workspace_elems, py::arg("batch"), py::arg("n"), py::arg("elem_size"),
        py::arg("device"), "elements of device workspace the solver needs for this problem (0: none)");
  m.def("cuda_device_count", &fastspec::cuda_device_count, "devices the extension's CUDA runtime sees (0 on error)");
#else
  m.attr("has_cuda") = false;
  m.attr("max_n_cuda") = 0;
#endif
}
