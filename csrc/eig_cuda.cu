// eig_cuda.cu — batched eigenvalues of real symmetric matrices, one thread block per matrix.
//
// Design envelope: n <= 256, aimed at n = 128 and batches of 256..4096 (one probe of a 1.5B
// model). fp32 and fp64. The per-matrix numerics are eig_core.h (shared with the host twin).
//   * block = round_up(n, 32) threads, capped at 256: one matrix column (and later one
//     eigenvalue) per thread. Reductions: warp shuffles + one shared word per warp.
//   * the full n x n matrix sits in shared memory when it fits (fp32 n <= 236, fp64 n <= 168
//     with the 227 KiB H100 opt-in limit); otherwise in a global workspace of one n x n matrix
//     per resident block (L1/L2 cached; correct, but this is where the kernel stops being good).
//   * work per 128 x 128 matrix: ~4.2 MFLOP tridiagonalization (full-storage rank-2 updates,
//     ~1.5x LAPACK's 4/3 n^3) + ~1.7 M ops Sturm bisection (128 eigenvalues x ~25 halvings x
//     128-step recurrence). 4096 matrices ~ 25 GFLOP, but shared-memory traffic (~3 accesses
//     per element per reflector, ~n^3 words per matrix) and ~7 barriers per reflector bound it.
//   * 64 KiB + 2.1 KiB of shared memory per 128 x 128 fp32 block: 3 blocks (12 warps) per H100 SM;
//     launch bounds ask for 3 resident blocks (64 registers fp32, 80 fp64, no spills on sm_90).
//   * the Householder vectors are read as 128-bit broadcasts (load4), so per matrix element and
//     reflector the block issues ~1 shared load for p = A u and ~2.5 (load, store, u/w) for the
//     rank-2 update, in 1/32-warp units. NOT MEASURED YET on a GPU: timings are open.
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
  void* scratch;  // >= 32 reals of shared memory
  __device__ int rank() const { return threadIdx.x; }
  __device__ int size() const { return blockDim.x; }
  __device__ void sync() const { __syncthreads(); }

  template <class Real, class Op> __device__ Real reduce(Real x, Op op) const {
    for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    Real* s = static_cast<Real*>(scratch);
    __syncthreads();  // the previous reduction's readers are done with scratch
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

__host__ __device__ constexpr int64_t round_up4(int64_t x) { return (x + 3) & ~int64_t(3); }

template <class Real>
__global__ void __launch_bounds__(kMaxThreads, 3)  // 3 blocks per SM: the shared-memory bound at n = 128
eigvalsh_batched_kernel(const Real* __restrict__ in, Real* __restrict__ out, Real* work, int64_t batch, int n,
                        int64_t sb, int64_t sr, int64_t sc, int64_t osb, bool matrix_in_smem) {
  extern __shared__ __align__(16) double smem_f64[];
  Real* sm = reinterpret_cast<Real*>(smem_f64);
  const int64_t nn = static_cast<int64_t>(n) * n;
  const int n4 = round_up4(n);  // every vector starts 16-byte aligned (load4 in eig_core.h)
  Work<Real> wk;
  wk.rs = n;
  wk.cs = 1;
  wk.a = matrix_in_smem ? sm : work + static_cast<int64_t>(blockIdx.x) * nn;
  wk.d = matrix_in_smem ? sm + round_up4(nn) : sm;
  wk.e = wk.d + n4;
  wk.v = wk.e + n4;
  wk.w = wk.v + n4;
  BlockTeam team{wk.w + n4};
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x)
    eigvalsh_one(team, in + b * sb, sr, sc, n, out + b * osb, wk);
}

template <class Real> size_t smem_bytes(int n, bool matrix_in_smem) {
  const int64_t nn = static_cast<int64_t>(n) * n;
  return sizeof(Real) * static_cast<size_t>((matrix_in_smem ? round_up4(nn) : 0) + 4 * round_up4(n) + 32);
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
  auto kernel = eigvalsh_batched_kernel<Real>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(p.smem)),
        "cudaFuncSetAttribute");
  kernel<<<static_cast<unsigned>(p.grid), p.threads, p.smem, stream>>>(in, out, work, batch, n, sb, sr, sc, osb,
                                                                      p.matrix_in_smem);
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
