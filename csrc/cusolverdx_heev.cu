// cusolverdx_heev.cu — NVIDIA cuSolverDx's `heev` (eigenvalues only) wrapped in a kernel with the
// launch contract of fastspec's own eigensolver, so that the race (benchmarks/eig_race.py), the
// bench's anchors and, where a measurement says so, the selection table can run it like any other
// algorithm. Device code only: compiled at run time by NVRTC to LTO IR (-dlto) and linked by
// nvJitLink with the device function libmathdx generated for this (n, dtype, arch) and cuSolverDx's
// own fatbin (fastspec/eig/mathdx.py, which sets the macros below from cuSolverDx's traits):
//   FS_REAL float | double, FS_N the matrix size, FS_THREADS the block size cuSolverDx suggests,
//   FS_BPB the matrices per block it suggests, FS_WORK the reals of its workspace per block,
//   FS_HEEV the name of the generated device function (extern "C"), FS_MIN_BLOCKS the resident
//   blocks per SM the launch bounds ask for (as many as shared memory allows, down to 128 registers
//   a thread: fastspec's own rule; nvJitLink 13.0 otherwise gives fp32 n = 128 ~170 registers and
//   one block per SM, 13.5 gives 128 unasked).
//
// Design envelope: whatever cuSolverDx's shared-memory API takes: each block holds FS_BPB whole
// n x n matrices in shared memory (column-major, leading dimension n), their eigenvalues, the
// workspace and the status words: fp32 n <= ~230 and fp64 n <= ~165 within the 227 KiB sm_90 opt-in
// (n = 128 fp32: 70 KiB; fp64: 139 KiB). No eigenvectors.
//   * load: A's lower triangle (rows r >= c), read along rows (coalesced) and stored transposed into
//     the column-major array (a[c * n + r]): cuSolverDx runs with fill mode lower and reads exactly
//     A's lower triangle, as fastspec.eigvalsh does. The transposed stores conflict in shared memory
//     (n apart), ~n^2/2 wavefronts per matrix, well under 1% of the solve; the alternatives that
//     store conflict-free (row-major, or the upper triangle) get cuSolverDx's other code path, 171-176
//     registers per thread at fp32 n = 128 against 128 (nvJitLink 13.5, sm_90). The upper half of
//     the shared array is never written or read.
//   * padding: a block's matrices past the batch are the identity (cuSolverDx's function is called
//     by the whole block on all FS_BPB matrices; nothing of them is written out).
//   * non-finite input (NaN/Inf anywhere in the triangle) or a non-zero status from cuSolverDx
//     (its QR iteration did not converge): that matrix's row of out is NaN, as fastspec's kernel
//     does, and info (when not null) gets the status, or -1 for non-finite input.
// Parameters: fastspec_eigvalsh's widths and order (three pointers, five 64-bit integers), the
// third pointer the optional int32 status per matrix (fastspec's kernel: its workspace), so the
// launcher (fastspec/eig/cuda.py) packs both the same way.
#ifndef FS_BPB
#define FS_BPB 1
#endif
#ifndef FS_MIN_BLOCKS
#define FS_MIN_BLOCKS 1
#endif
#define FS_NAN __int_as_float(0x7fffffff)  // NVRTC has no <cmath>: a quiet NaN, converted to double there

extern "C" __device__ void FS_HEEV(FS_REAL* a, FS_REAL* lambda, FS_REAL* work, int* info);

namespace {
constexpr int kN = FS_N;
constexpr int kNN = FS_N * FS_N;
constexpr int kBpb = FS_BPB;
constexpr int kThreads = FS_THREADS;
}

extern "C" __global__ void __launch_bounds__(FS_THREADS, FS_MIN_BLOCKS)
fastspec_cusolverdx_heev(const FS_REAL* __restrict__ A, FS_REAL* __restrict__ out, int* __restrict__ info_out,
                         long long batch, long long sb, long long sr, long long sc, long long out_stride) {
  extern __shared__ __align__(16) unsigned char smem[];
  FS_REAL* a = reinterpret_cast<FS_REAL*>(smem);  // [FS_BPB][n][n], column-major per matrix
  FS_REAL* lambda = a + kBpb * kNN;                 // [FS_BPB][n]
  FS_REAL* work = lambda + kBpb * kN;               // [FS_WORK] for the block's matrices
  int* info = reinterpret_cast<int*>(work + FS_WORK);  // [FS_BPB]
  const long long first = static_cast<long long>(blockIdx.x) * kBpb;

  int bad = 0;  // this thread saw a non-finite element (of any of the block's matrices)
  __shared__ int nonfinite[kBpb];
  for (int k = threadIdx.x; k < kBpb; k += kThreads) nonfinite[k] = 0;
  __syncthreads();
  for (int k = 0; k < kBpb; ++k) {
    const long long m = first + k;
    FS_REAL* ak = a + k * kNN;
    if (m < batch) {
      const FS_REAL* Am = A + m * sb;
      for (int i = threadIdx.x; i < kNN; i += kThreads) {
        const int r = i / kN, c = i - r * kN;
        if (r >= c) {
          const FS_REAL x = Am[r * sr + c * sc];
          bad |= !(x - x == x - x);  // false for NaN and +-Inf alone (x - x is NaN)
          ak[c * kN + r] = x;
        }
      }
      if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0) nonfinite[k] = 1;
      }
      bad = 0;
    } else {
      for (int i = threadIdx.x; i < kNN; i += kThreads) {
        const int r = i / kN, c = i - r * kN;
        if (r >= c) ak[c * kN + r] = static_cast<FS_REAL>(r == c);
      }
    }
  }
  __syncthreads();
  FS_HEEV(a, lambda, work, info);  // every thread of the block: a block-wide device function
  __syncthreads();
  for (int k = 0; k < kBpb; ++k) {
    const long long m = first + k;
    if (m >= batch) break;
    const bool failed = nonfinite[k] || info[k] != 0;
    FS_REAL* o = out + m * out_stride;
    for (int i = threadIdx.x; i < kN; i += kThreads) o[i] = failed ? static_cast<FS_REAL>(FS_NAN) : lambda[k * kN + i];
    if (info_out != nullptr && threadIdx.x == 0) info_out[m] = nonfinite[k] ? -1 : info[k];
  }
}
