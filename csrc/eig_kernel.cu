// eig_kernel.cu — batched eigenvalues of real symmetric matrices, one thread block per matrix.
// Device code only: compiled at first use by NVRTC (fastspec/eig/nvrtc.py), one cubin per
// (n, dtype, layout, arch), with these macros set by the launcher (fastspec/eig/cuda.py):
//   FS_REAL float | double, FS_N the matrix size, FS_SMEM 1 when the matrix sits in shared memory,
//   FS_THREADS the block size, FS_MIN_BLOCKS the resident blocks the register budget is sized for.
// n is a compile-time constant: every loop bound and row stride of eig_core.h folds, so every n
// gets the constant row offsets that only n = 128 had when n was a run-time argument.
//
// Design envelope: n <= AUTO_MAX_N (fastspec/eig/limits.py, where every limit is written), aimed
// at n = 128 and batches of 256..4096 (one probe of a 1.5B model). fp32 and fp64. The per-matrix
// numerics are eig_core.h (shared with the host twin).
//   * block = round_up(n, 32) threads, capped at FS_MAX_THREADS (FS_THREADS): one matrix column
//     (and later one eigenvalue) per thread. Reductions: warp shuffles + one shared word per warp, two
//     alternating scratch halves (one barrier per reduction).
//   * the full matrix sits in shared memory when it fits, rows padded to n + 1 (a column's entries
//     in distinct banks): fp32 n <= 237, fp64 n <= 166 within the 227 KiB H100 opt-in; otherwise
//     a global workspace of one n x n matrix per resident block (L1/L2 cached; correct, but this
//     is where the kernel stops being good). Whether it does is a compile-time constant, so the
//     compiler knows the address space: LDS/STS, no generic LD/ST (tests/test_eig_sass.py).
//   * 67.75 KiB of shared memory per 128 x 128 fp32 block, carveout set to all-shared: 3 blocks
//     (12 warps) per H100 SM; launch bounds ask for 3 (FS_MIN_BLOCKS; no spills on sm_90).
//
// Cost model, fp32 n = 128, 4 warps per matrix (SASS from NVRTC 13 for sm_90, counted by
// fastspec.bench.sass; tests/test_eig_sass.py keeps the counts honest). Per matrix:
//   * tridiagonalization, one fused pass per reflector (rank-2 update of reflector j-1 + p of
//     reflector j): 2.75 shared wavefronts per element and warp (3 FFMA, LDS + STS of the
//     element, 3/4 LDS.128 broadcast of u, w, u_next) and 6.75-6.9 instructions (54-55 per
//     8-row iteration: n, and so the row stride, is a compile-time constant). Sum over
//     reflectors of warps x rows: 26.0k warp-iterations -> ~178k instructions, ~72k wavefronts.
//     Per-reflector rest (column update, reflector, w, 5 barriers):
//     ~120 instructions per warp -> ~60k. (Before: a generic-pointer p pass + a separate update,
//     ~16 instructions and 3.75 accesses per element, 7 barriers per reflector.)
//   * eigenvalues: one Sturm sweep at 127 grid points brackets each eigenvalue to 1/128 of the
//     Gerschgorin interval, then ~18 bisection sweeps of 128 steps; one step = 7.3 (NVRTC
//     13.5) to 7.9 (13.0) instructions (LDS.64 of (e^2, d), FADD, MUFU.RCP, FFMA, pivmin guard, sign-bit count; no
//     IEEE-division slow path; the loop unrolled, n being known) -> ~71-77k instructions, ~10k
//     wavefronts. Rank sort: ~3k.
//   * load (coalesced row reads, 8 rows in flight per thread) + exact power-of-two scaling: ~12k.
//   => ~325-330k warp instructions and ~83k shared wavefronts per matrix. An SM issues 4 warp
//      instructions and one shared wavefront per cycle: ~82k cycles issue bound, ~83k shared
//      bound. 4096 matrices = 31 per SM: PREDICTED ~1.3-1.5 ms on H100 SXM (1.75-1.98 GHz),
//      if 12 warps per SM hide the latencies. Target <= 2 ms; the 1 ms stretch needs the matrix
//      in registers (2 threads per column, no LDS/STS of the element: ~4 instructions per
//      element and reflector). MEASURED on an H200 (2026-11-26, NVRTC 13.0, 1.98 GHz): 3.69 ms
//      (3.36 ms under Nsight Compute); 394k warp instructions per matrix (predicted 325-330k),
//      issue slots busy 46% (1.86 of 4 per cycle), 0.61 eligible warps per scheduler, 3 blocks
//      per SM (the 69 KB of shared memory): latency bound, 2.2x the issue bound. More
//      independent warps per SM is the next step: the candidate algorithms of eig_algos.h
//      (packed: half the shared memory; regs: the matrix in registers; split: two threads per
//      column) are raced against this one by the GPU kit (benchmarks/eig_race.py).
//   * n > AUTO_MAX_N (up to FS_MAX_N) runs, on the workspace path; fastspec.eigvalsh's "auto"
//     sends it to torch.linalg.eigvalsh.
// No headers at all (NVRTC has none): raw device pointers and element strides.
//
// Other algorithms (FS_ALGO, eig_algos.h: the candidates of fastspec/eig/variants.py, chosen per GPU,
// dtype, n and batch by measurement) share this entry point and its launch contract; each header
// carries its own design envelope and cost model. They always keep their data in shared memory
// (or registers): FS_SMEM is 1 for them.
#include "eig_algos.h"

#if !defined(FS_REAL) || !defined(FS_N) || !defined(FS_SMEM) || !defined(FS_THREADS) || !defined(FS_MIN_BLOCKS)
#error "compiled by fastspec/eig/nvrtc.py: it defines FS_REAL, FS_N, FS_SMEM, FS_THREADS, FS_MIN_BLOCKS"
#endif
#if !defined(FS_ALGO)
#define FS_ALGO 0  // the block algorithm (eig_core.h)
#endif
#if !defined(FS_PROFILE)
#define FS_PROFILE 0  // 1: the profiling build (below); fastspec/eig/profile.py asks for it, nothing else does
#endif
static_assert(FS_PROFILE == 0 || FS_SMEM == 1, "FS_PROFILE: the profiling build takes the work pointer for its record");
static_assert(FS_N >= 1 && FS_N <= fastspec::kMaxN, "FS_N: outside [1, FS_MAX_N] (fastspec/eig/limits.py)");
static_assert(FS_THREADS <= fastspec::kMaxThreads, "FS_THREADS: above FS_MAX_THREADS (fastspec/eig/limits.py)");
static_assert(FS_ALGO >= 0 && FS_ALGO < fastspec::kAlgoCount, "FS_ALGO: not an algorithm of eig_algos.h");
static_assert(FS_ALGO == 0 || (FS_SMEM == 1 && FS_N <= fastspec::algo_max_n(FS_ALGO) &&
                               FS_THREADS == fastspec::algo_threads(FS_ALGO, FS_N)),
              "FS_ALGO: a candidate algorithm needs FS_SMEM 1, FS_N within its limit and its own team size");

namespace fastspec {

// The profiling build (FS_PROFILE 1): `work` is a record of kProfSlots 64-bit words per block of the
// grid, the normal build's launch contract otherwise (the matrix must be in shared memory). Slot 0:
// (SM id << 32) | the number of marks the block made (written last); slot 1: %globaltimer (ns) at the
// block's start, slot 2 at its end; then one word per FS_PHASE mark while they fit: (phase << 56) |
// the low 56 bits of clock64() (SM cycles). Member 0 writes them: fire-and-forget global stores, a
// few instructions per mark (~1.5k marks per 128 x 128 matrix against ~300k warp instructions), and
// every other member keeps the same counters in registers without storing. fastspec/eig/profile.py
// decodes the record (the same layout: kProfHead, kProfSlots there).
constexpr int kProfHead = 3;
constexpr int kProfSlots = 4096;
constexpr unsigned long long kProfClockMask = (1ull << 56) - 1;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Team = the thread block of kSize threads, a multiple of 32 (full-warp shuffles). The size is a
// compile-time constant: strided loops over n <= kSize members become one predicated pass.
template <int kSize> struct BlockTeam {
  static_assert(kSize % 32 == 0 && kSize > 0, "block size: a multiple of 32");
  static constexpr int kHalf = kScratch / 2;  // one real per warp in each scratch half
  static_assert(kSize / 32 <= kHalf, "FS_SCRATCH: too small for this block's warps");
  void* scratch;  // kScratch reals of shared memory
  mutable unsigned parity;  // which half of scratch the next reduction uses
#if FS_PROFILE
  unsigned long long* record;  // this block's kProfSlots words
  mutable int marks;    // marks made so far (member 0 stores those below kProfSlots - kProfHead)
  mutable int current;  // the phase a barrier resumes
  __device__ void phase(int p) const {
    if (threadIdx.x == 0 && marks < kProfSlots - kProfHead)
      record[kProfHead + marks] = (static_cast<unsigned long long>(p) << 56) | (clock64() & kProfClockMask);
    ++marks;
    current = p;
  }
  __device__ void barrier() const {
    const int resume = current;
    phase(kPhaseBarrier);
    __syncthreads();
    phase(resume);
  }
#else
  __device__ void phase(int) const {}
  __device__ void barrier() const { __syncthreads(); }
#endif
  __device__ int rank() const { return threadIdx.x; }
  __device__ int size() const { return kSize; }
  __device__ void sync(int = 0) const { barrier(); }

  template <class Real, class Op> __device__ Real reduce(Real x, Op op) const {
    for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    // two scratch halves, alternating: one barrier per reduction. Reduction i + 2 reuses the half
    // of reduction i only after every thread has passed reduction i + 1's barrier, which each
    // reaches after folding reduction i's totals (all threads run the same reductions in order).
    Real* s = static_cast<Real*>(scratch) + (parity++ & 1u) * kHalf;
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = x;
    barrier();
    // every thread folds the warp totals in the same order: bitwise-identical result everywhere,
    // so branches on it are block-uniform
    Real t = s[0];
    for (int i = 1; i < kSize / 32; ++i) t = op(t, s[i]);
    return t;
  }
  template <class Real> __device__ Real sum(Real x) const {
    return reduce(x, [](Real a, Real b) { return a + b; });
  }
  template <class Real> __device__ Real max(Real x) const {
    return reduce(x, [](Real a, Real b) { return a > b ? a : b; });  // inf propagates, NaN never enters
  }
};

}  // namespace fastspec

// The one entry point of a compiled variant (extern "C": an unmangled name to look up).
// in: batch matrices [n, n] at in + b*sb, element (r, c) at r*sr + c*sc (lower triangle read);
// out: batch vectors [n] at out + b*osb, ascending. Strides in elements. work: one n x n matrix per
// block of the grid when FS_SMEM is 0 (unused otherwise). Dynamic shared memory:
// sizeof(FS_REAL) * (block_work_elems(FS_N, FS_SMEM) + FS_SCRATCH) bytes for the block algorithm,
// sizeof(FS_REAL) * (algo_smem_elems(FS_ALGO, FS_N) + FS_SCRATCH) for the others (fastspec/eig/cuda.py's plan).
extern "C" __global__ void __launch_bounds__(FS_THREADS, FS_MIN_BLOCKS)
fastspec_eigvalsh(const FS_REAL* __restrict__ in, FS_REAL* __restrict__ out, FS_REAL* work, long long batch,
                  long long sb, long long sr, long long sc, long long osb) {
  using namespace fastspec;
  // The matrix's location is a compile-time constant, not a run-time choice: with FS_SMEM the
  // compiler sees every matrix pointer derive from the __shared__ array and emits LDS/STS (a
  // run-time select between shared and global memory compiles to generic LD/ST, slower on every
  // access).
  extern __shared__ __align__(16) double smem_f64[];
  FS_REAL* sm = reinterpret_cast<FS_REAL*>(smem_f64);
  const bool in_smem = FS_SMEM != 0;
  // the reduction scratch follows the work memory
  FS_REAL* const scratch = sm + (FS_ALGO != 0 ? algo_smem_elems(FS_ALGO, FS_N) : block_work_elems(FS_N, in_smem));
#if FS_PROFILE
  unsigned long long* const record = reinterpret_cast<unsigned long long*>(work) + static_cast<int64_t>(blockIdx.x) * kProfSlots;
  if (threadIdx.x == 0) record[1] = global_ns();
  const BlockTeam<FS_THREADS> team{scratch, 0u, record, 0, kPhaseLoad};
#else
  const BlockTeam<FS_THREADS> team{scratch, 0u};
#endif
#if FS_ALGO != 0
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x)
    algo_eigvalsh_one<FS_ALGO>(team, in + b * sb, sr, sc, FS_N, out + b * osb, sm);
#else
  const Work<FS_REAL> wk =
      block_work(sm, in_smem ? nullptr : work + static_cast<int64_t>(blockIdx.x) * FS_N * FS_N, FS_N);
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x)
    eigvalsh_one(team, in + b * sb, sr, sc, FS_N, out + b * osb, wk);
#endif
#if FS_PROFILE
  if (threadIdx.x == 0) {
    record[2] = global_ns();
    record[0] = (static_cast<unsigned long long>(sm_id()) << 32) | static_cast<unsigned>(team.marks);
  }
#endif
}
