// eig_cuda.cu — batched eigenvalues of real symmetric matrices, one thread block per matrix.
//
// Design envelope: n <= 256, aimed at n = 128 and batches of 256..4096 (one probe of a 1.5B
// model). fp32 and fp64. The per-matrix numerics are eig_core.h (shared with the host twin).
//   * block = round_up(n, 32) threads, capped at 256: one matrix column (and later one
//     eigenvalue) per thread. Reductions: warp shuffles + one shared word per warp, two
//     alternating scratch halves (one barrier per reduction).
//   * the full matrix sits in shared memory when it fits, rows padded to n + 1 (a column's entries
//     in distinct banks): fp32 n <= 237, fp64 n <= 166 within the 227 KiB H100 opt-in; otherwise
//     a global workspace of one n x n matrix per resident block (L1/L2 cached; correct, but this
//     is where the kernel stops being good). Whether it does is a template parameter, so the
//     compiler knows the address space: LDS/STS, no generic LD/ST (tests/test_eig_sass.py).
//   * 67.75 KiB of shared memory per 128 x 128 fp32 block, carveout set to all-shared: 3 blocks
//     (12 warps) per H100 SM; launch bounds ask for 3 (80 registers, no spills on sm_90).
//
// Cost model, fp32 n = 128, 4 warps per matrix (SASS from nvcc 13.0 for sm_90, counted by
// fastspec.bench.sass; tests/test_eig_sass.py keeps the counts honest). Per matrix:
//   * tridiagonalization, one fused pass per reflector (rank-2 update of reflector j-1 + p of
//     reflector j): 2.75 shared wavefronts per element and warp (3 FFMA, LDS + STS of the
//     element, 3/4 LDS.128 broadcast of u, w, u_next) and 7.4 instructions (59 per 8-row
//     iteration with n = 128's row stride a compile-time constant; 8.25 for other n). Sum over
//     reflectors of warps x rows: 26.0k warp-iterations -> ~193k instructions, ~72k wavefronts.
//     Per-reflector rest (column update, reflector, w, 5 barriers):
//     ~120 instructions per warp -> ~60k. (Before: a generic-pointer p pass + a separate update,
//     ~16 instructions and 3.75 accesses per element, 7 barriers per reflector.)
//   * eigenvalues: one Sturm sweep at 127 grid points brackets each eigenvalue to 1/128 of the
//     Gerschgorin interval, then ~18 bisection sweeps of 128 steps; one step = 8.25
//     instructions (LDS.64 of (e^2, d), FADD, MUFU.RCP, FFMA, pivmin guard, sign-bit count; no
//     IEEE-division slow path) -> ~80k instructions, ~10k wavefronts. Rank sort: ~3k.
//   * load (coalesced row reads, 8 rows in flight per thread) + exact power-of-two scaling: ~12k.
//   => ~350k warp instructions and ~83k shared wavefronts per matrix. An SM issues 4 warp
//      instructions and one shared wavefront per cycle: ~87k cycles issue bound, ~83k shared
//      bound. 4096 matrices = 31 per SM: PREDICTED ~1.4-1.6 ms on H100 SXM (1.75-1.98 GHz),
//      if 12 warps per SM hide the latencies. Target <= 2 ms; the 1 ms stretch needs the matrix
//      in registers (2 threads per column, no LDS/STS of the element: ~4 instructions per
//      element and reflector). NOT MEASURED on a GPU yet.
//   * larger n: not handled here; fastspec.eigvalsh falls back to torch.linalg.eigvalsh.
// No torch headers, no libtorch: raw device pointers, element strides and a cudaStream_t, so the
// same entry serves torch tensors and CuPy arrays.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "eig_core.h"
#include "eig_cuda.h"

namespace fastspec {
namespace {

// Team = the thread block. Requires blockDim.x to be a multiple of 32 (full-warp shuffles).
struct BlockTeam {
  void* scratch;  // >= 64 reals of shared memory
  mutable unsigned parity;  // which half of scratch the next reduction uses
  __device__ int rank() const { return threadIdx.x; }
  __device__ int size() const { return blockDim.x; }
  __device__ void sync() const { __syncthreads(); }

  template <class Real, class Op> __device__ Real reduce(Real x, Op op) const {
    for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    // two scratch halves, alternating: one barrier per reduction. Reduction i + 2 reuses the half
    // of reduction i only after every thread has passed reduction i + 1's barrier, which each
    // reaches after folding reduction i's totals (all threads run the same reductions in order).
    Real* s = static_cast<Real*>(scratch) + (parity++ & 1u) * 32;
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = x;
    __syncthreads();
    // every thread folds the warp totals in the same order: bitwise-identical result everywhere,
    // so branches on it are block-uniform
    Real t = s[0];
    for (int i = 1; i < static_cast<int>(blockDim.x >> 5); ++i) t = op(t, s[i]);
    return t;
  }
  template <class Real> __device__ Real sum(Real x) const {
    return reduce(x, [](Real a, Real b) { return a + b; });
  }
  template <class Real> __device__ Real max(Real x) const {
    return reduce(x, [](Real a, Real b) { return a > b ? a : b; });  // inf propagates, NaN never enters
  }
};

constexpr int kMaxThreads = 256;

// The matrix's location is a template parameter, not a run-time choice: with kSmem the compiler
// sees every matrix pointer derive from the __shared__ array and emits LDS/STS (a run-time select
// between shared and global memory compiles to generic LD/ST, slower on every access).
// Resident blocks per SM the register budget is sized for: 3 for fp32 with the matrix in shared
// memory (the shared-memory bound at n = 128: 80 registers, no spills). fp64's 128 x 128 matrix
// takes 129 KiB, one block per SM, and the global-workspace path runs at most 4 blocks of up to
// 256 threads per SM anyway: 2 (up to 128 registers) keeps both free of spills.
template <class Real, bool kSmem> constexpr int kMinBlocks = (sizeof(Real) == 4 && kSmem) ? 3 : 2;

template <class Real, bool kSmem>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks<Real, kSmem>)
eigvalsh_batched_kernel(const Real* __restrict__ in, Real* __restrict__ out, Real* work, int64_t batch, int n,
                        int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  extern __shared__ __align__(16) double smem_f64[];
  Real* sm = reinterpret_cast<Real*>(smem_f64);
  const Work<Real> wk = block_work(sm, kSmem ? nullptr : work + static_cast<int64_t>(blockIdx.x) * n * n, n);
  BlockTeam team{sm + block_work_elems(n, kSmem), 0u};  // reduction scratch after the work arrays
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x)
    eigvalsh_one(team, in + b * sb, sr, sc, n, out + b * osb, wk);
}

template <class Real> size_t smem_bytes(int n, bool matrix_in_smem) {
  // the work arrays (eig_core.h's block layout), then 2 x 32 reals of reduction scratch
  return sizeof(Real) * static_cast<size_t>(block_work_elems(n, matrix_in_smem) + 64);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("fastspec eigvalsh CUDA: ") + what + ": " + cudaGetErrorString(err));
}

struct Plan {
  bool matrix_in_smem;
  size_t smem;
  int threads;
  int64_t grid;
};

template <class Real> Plan plan(int64_t batch, int n, int device) {
  int smem_optin = 0, sms = 0;
  check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "device attribute");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device attribute");
  Plan p;
  p.matrix_in_smem = smem_bytes<Real>(n, true) <= static_cast<size_t>(smem_optin);
  p.smem = smem_bytes<Real>(n, p.matrix_in_smem);
  p.threads = ((n + 31) / 32) * 32;
  if (p.threads > kMaxThreads) p.threads = kMaxThreads;
  // the global-workspace path keeps one matrix per block: bound the grid (and the workspace)
  const int64_t cap = p.matrix_in_smem ? static_cast<int64_t>(INT_MAX) : static_cast<int64_t>(sms) * 4;
  p.grid = batch < cap ? batch : cap;
  return p;
}

template <class Real>
void launch(const Real* in, Real* out, Real* work, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
            int64_t osb, int device, cudaStream_t stream) {
  if (batch == 0) return;
  int previous = 0;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  const Plan p = plan<Real>(batch, n, device);
  if (!p.matrix_in_smem && work == nullptr) throw std::invalid_argument("work: a workspace is needed for this n");
  auto kernel = p.matrix_in_smem ? eigvalsh_batched_kernel<Real, true> : eigvalsh_batched_kernel<Real, false>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(p.smem)),
        "cudaFuncSetAttribute");
  // all of the unified L1/shared array as shared memory: the default carveout may leave room for
  // fewer resident blocks than the shared-memory footprint allows
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
        "cudaFuncSetAttribute");
  kernel<<<static_cast<unsigned>(p.grid), p.threads, p.smem, stream>>>(in, out, work, batch, n, sb, sr, sc, osb);
  const cudaError_t err = cudaGetLastError();
  cudaSetDevice(previous);
  check(err, "kernel launch");
}

}  // namespace

int64_t cuda_workspace_elems(int64_t batch, int n, int elem_size, int device) {
  if (batch == 0) return 0;
  const Plan p = elem_size == 4 ? plan<float>(batch, n, device) : plan<double>(batch, n, device);
  return p.matrix_in_smem ? 0 : p.grid * static_cast<int64_t>(n) * n;
}

void cuda_eigvalsh_f32(const float* in, float* out, float* work, int64_t batch, int n, int64_t sb, int64_t sr,
                       int64_t sc, int64_t osb, int device, void* stream) {
  launch<float>(in, out, work, batch, n, sb, sr, sc, osb, device, static_cast<cudaStream_t>(stream));
}

void cuda_eigvalsh_f64(const double* in, double* out, double* work, int64_t batch, int n, int64_t sb, int64_t sr,
                       int64_t sc, int64_t osb, int device, void* stream) {
  launch<double>(in, out, work, batch, n, sb, sr, sc, osb, device, static_cast<cudaStream_t>(stream));
}

int cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

}  // namespace fastspec
