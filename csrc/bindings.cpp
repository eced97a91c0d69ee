// bindings.cpp — pybind11 module fastspec.eig._host: the host twin of the CUDA eigensolver and its
// team emulation, and (tests only) the host twin of the DMMA Gram kernel pair (cov_gram_host.cpp).
// Raw pointers in, no torch, no numpy types: pointers are integers (tensor.data_ptr()), strides are
// in elements. The CUDA kernels themselves are not in this module: they are compiled at run time by
// NVRTC (fastspec/eig/nvrtc.py). The module reports the limits it was compiled with (MAX_N, ...:
// the macros of fastspec/eig/limits.py), so Python can tell a stale build.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "cov_gram_host.h"
#include "eig_algos.h"
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

template <class Real, std::vector<int> (*F)(const Real*, Real*, int64_t, int, int64_t, int64_t, int64_t, int64_t, int,
                                            int, int64_t, int)>
std::vector<int> team_entry(uintptr_t in, uintptr_t out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                            int64_t osb, int algo, int schedule, int64_t drop, bool phases) {
  check_problem(in, out, batch, n);
  if (algo < 0 || algo >= fastspec::kAlgoCount)
    throw std::invalid_argument("algo: must be in [0, " + std::to_string(fastspec::kAlgoCount) + "), got " +
                                std::to_string(algo));
  if (n > fastspec::algo_max_n(algo))
    throw std::invalid_argument("n: algorithm " + std::to_string(algo) + " takes n <= " +
                                std::to_string(fastspec::algo_max_n(algo)) + ", got " + std::to_string(n));
  if (schedule < 0 || schedule > 2) throw std::invalid_argument("schedule: must be 0, 1 or 2");
  py::gil_scoped_release release;
  return F(reinterpret_cast<const Real*>(in), reinterpret_cast<Real*>(out), batch, n, sb, sr, sc, osb, algo, schedule,
           drop, phases ? fastspec::kRecordPhases : fastspec::kRecordSites);
}

const char* const kCovMacros[] = {"FS_COV_D", "FS_COV_IN", "FS_COV_ROWS", "FS_COV_THREADS", "FS_COV_MIN_BLOCKS"};

py::dict cov_gram_stats(const fastspec::CovGramStats& s) {
  return py::dict(py::arg("blocks") = s.blocks, py::arg("syncthreads") = s.syncthreads,
                  py::arg("all_sync") = s.all_sync, py::arg("mma") = s.mma, py::arg("switches") = s.switches);
}

// cov_gram.cu's entry `entry`, compiled with `defines`, on the software GPU (cov_gram_host.h)
py::dict cov_gram_launch(const std::string& entry, const std::map<std::string, int64_t>& defines,
                         const std::array<int64_t, 3>& grid, const std::array<int64_t, 3>& block, int64_t smem,
                         const std::vector<int64_t>& args, int order) {
  int e;
  if (entry == "fastspec_cov_gram") {
    e = fastspec::kCovGramEntry;
  } else if (entry == "fastspec_cov_gram_reduce") {
    e = fastspec::kCovGramReduceEntry;
  } else {
    throw std::invalid_argument("entry: fastspec_cov_gram or fastspec_cov_gram_reduce, got " + entry);
  }
  int64_t v[5];
  for (int i = 0; i < 5; ++i) {
    const auto it = defines.find(kCovMacros[i]);
    if (it == defines.end()) throw std::invalid_argument(std::string("defines: ") + kCovMacros[i] + " missing");
    v[i] = it->second;
  }
  if (defines.size() != 5) throw std::invalid_argument("defines: only the five FS_COV_* macros of cov_gram.cu");
  const fastspec::CovGramConfig config{int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4])};
  py::gil_scoped_release release;
  const fastspec::CovGramStats stats = fastspec::cov_gram_launch(e, config, grid.data(), block.data(), smem, args, order);
  py::gil_scoped_acquire acquire;
  return cov_gram_stats(stats);
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
      "(in_ptr, out_ptr, batch, n, stride_batch, stride_row, stride_col, out_stride_batch, algo=0, schedule=0, "
      "drop=-1, phases=False) -> [line of each barrier], or with phases=True [every FS_PHASE mark of rank 0, "
      "barriers included: the sequence the kernel's profiling build stamps]: tests only; algorithm `algo` of the CUDA kernel run by a team of ranks "
      "(fibers: its team size, barriers, reduction order and shared-memory layout). schedule 0: two OS threads at "
      "once; 1/2: one rank at a time in rank order / reverse rank order (deterministic). drop: the barrier (index in "
      "the returned list) every rank leaves out. Slow.";
  m.def("team_eigvalsh_f32", &team_entry<float, fastspec::team_eigvalsh_f32>, team_doc, py::arg("in_ptr"),
        py::arg("out_ptr"), py::arg("batch"), py::arg("n"), py::arg("stride_batch"), py::arg("stride_row"),
        py::arg("stride_col"), py::arg("out_stride_batch"), py::arg("algo") = 0, py::arg("schedule") = 0,
        py::arg("drop") = -1, py::arg("phases") = false);
  m.def("team_eigvalsh_f64", &team_entry<double, fastspec::team_eigvalsh_f64>, team_doc, py::arg("in_ptr"),
        py::arg("out_ptr"), py::arg("batch"), py::arg("n"), py::arg("stride_batch"), py::arg("stride_row"),
        py::arg("stride_col"), py::arg("out_stride_batch"), py::arg("algo") = 0, py::arg("schedule") = 0,
        py::arg("drop") = -1, py::arg("phases") = false);
  m.attr("ALGOS") = py::dict(py::arg("block") = int(fastspec::kAlgoBlock), py::arg("packed") = int(fastspec::kAlgoPacked),
                             py::arg("regs") = int(fastspec::kAlgoRegs), py::arg("split") = int(fastspec::kAlgoSplit),
                             py::arg("newton") = int(fastspec::kAlgoNewton));
  m.attr("PHASES") = py::dict(py::arg("load") = int(fastspec::kPhaseLoad), py::arg("reflector") = int(fastspec::kPhaseReflector),
                              py::arg("update") = int(fastspec::kPhaseUpdate), py::arg("product") = int(fastspec::kPhaseProduct),
                              py::arg("barrier") = int(fastspec::kPhaseBarrier), py::arg("isolate") = int(fastspec::kPhaseIsolate),
                              py::arg("refine") = int(fastspec::kPhaseRefine), py::arg("sort") = int(fastspec::kPhaseSort),
                              py::arg("end") = int(fastspec::kPhaseEnd));
  m.def("algo_threads", [](int algo, int n) { return fastspec::algo_threads(algo, n); }, py::arg("algo"), py::arg("n"),
        "team (CUDA block) size of algorithm `algo` for n x n matrices (eig_algos.h)");
  m.def("algo_smem_elems", [](int algo, int n) { return fastspec::algo_smem_elems(algo, n); }, py::arg("algo"),
        py::arg("n"), "reals of shared work memory of algorithm `algo` (before the reduction scratch)");
  m.def("algo_max_n", [](int algo) { return fastspec::algo_max_n(algo); }, py::arg("algo"),
        "largest n algorithm `algo` takes");
  m.def("block_work_elems", [](int n, bool matrix_here) { return fastspec::block_work_elems(n, matrix_here); },
        py::arg("n"), py::arg("matrix_here"),
        "reals of one CUDA block's work arrays (eig_core.h); tests check the launcher's copy of the formula");

  // the host twin of the DMMA Gram kernel pair (tests only)
  m.attr("COV_GRAM_TWIN") = fastspec::kCovGramTwin;
  py::list configs;
  for (const fastspec::CovGramConfig& c : fastspec::cov_gram_configs()) {
    const int values[5] = {c.d, c.in, c.rows, c.threads, c.min_blocks};
    py::dict d;
    for (int i = 0; i < 5; ++i) d[kCovMacros[i]] = values[i];
    configs.append(d);
  }
  m.attr("COV_GRAM_CONFIGS") = configs;
  m.def("cov_gram_launch", &cov_gram_launch, py::arg("entry"), py::arg("defines"), py::arg("grid"), py::arg("block"),
        py::arg("smem"), py::arg("args"), py::arg("order") = 0,
        "(entry, defines, grid, block, smem, args, order=0) -> {blocks, syncthreads, all_sync, mma, switches}: "
        "tests only; csrc/cov_gram.cu's entry `entry` (fastspec_cov_gram or fastspec_cov_gram_reduce) as compiled "
        "with `defines` ({FS_COV_D, FS_COV_IN, FS_COV_ROWS, FS_COV_THREADS, FS_COV_MIN_BLOCKS}: one of "
        "COV_GRAM_CONFIGS), launched on the host twin's software GPU (cov_gram_host.cpp: one fiber per CUDA thread, "
        "blocks in order, on this OS thread) with `grid`, `block`, `smem` bytes of dynamic shared memory and the "
        "kernel's parameters `args` in order (pointers as integers, host memory: what gram_cuda.launch_args / "
        "reduce_args pack). order 0: a block's threads in thread order, 1 reversed. Returns what the software "
        "GPU counted (collectives resolved, fiber switches). Without <ucontext.h>: RuntimeError.");
}
