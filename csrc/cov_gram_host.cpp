// cov_gram_host.cpp — host twin of the DMMA Gram kernel pair (cov_gram.cu): the kernels' own source,
// compiled by the C++ compiler, run on a software GPU. Tests only (fastspec.eig._host's
// cov_gram_launch; tests/test_cov_gram_cuda.py).
//
// Why: the numpy model (tests/_cov_gram_emulation.py) re-derives the kernel's tiles from its
// macros and roles table; it never runs the kernel's address arithmetic, its operand order, its
// pair_slot/put bookkeeping or the fetch/advance carries. A swapped operand pair in one dmma(...)
// call, or a transposed fragment expression, passed every CPU test. Here the kernel's code itself
// runs, given exactly the pointers, strides, grid and block a launch packs, so such a mistake
// gives a wrong Gram on CPU; and the twin and the model check each other bit for bit.
//
// What is emulated:
//   * one fiber (ucontext) per CUDA thread of a block; blocks run one after another over the grid
//     (x fastest, then y, z), all on the calling OS thread: deterministic. threadIdx, blockIdx,
//     blockDim, gridDim are the running fiber's.
//   * the schedule: a fiber runs until it reaches a collective, then hands over to the next ready
//     fiber in thread order (or reversed: `order` 1; the results must not depend on it). A
//     collective resolves when its last participant arrives, which then goes on without a switch:
//       __syncthreads()  the block's barrier (threads that have exited do not hold it);
//       __all_sync       a warp collective: the 32 lanes of that warp only (at D = 32/64 the warps
//                        take different branches and different numbers of dmma calls);
//       mma.m8n8k4.f64   a warp collective (the dmma() asm, under FS_COV_HOST): each lane brings its
//                        fragments, the last one computes D = C + A B for all 32 lanes.
//     A deadlock (a collective some thread never reaches, lanes of a warp at different collectives,
//     a lane exiting while its warp waits) stops the launch with an error instead of hanging.
//   * mma.m8n8k4 with .f64 as the PTX ISA defines its fragments (section 9.7.14.5.2, "Matrix
//     Fragments for mma.m8n8k4 with .f64 floating point type"): lane l holds A[l >> 2][l & 3],
//     B[l & 3][l >> 2] and C/D[l >> 2][2 (l & 3) + v], v = 0, 1; each element of D is
//     c + a0 b0, then + a1 b1, + a2 b2, + a3 b3: float64 products and adds in k order, never
//     fused (the numpy model's arithmetic, so the two agree bit for bit).
//   * shared memory: __shared__ is thread_local (one OS thread runs a block's fibers, so they
//     share it; launches on other OS threads get their own). The dynamic part (`extern __shared__
//     double smem[]`, a C-linkage name: every configuration's kernel refers to the one array
//     defined below) is poisoned with NaN before every block, as uninitialized shared memory may
//     hold anything; the bytes past the launch's dynamic size are a canary, checked after the
//     block (a write there is an error, a read gives NaN).
//   * the device intrinsics the kernel uses: __ldg (a plain load), __float_as_uint,
//     __uint_as_float, __double2hiint, min/max, sqrt, and cvt.f32.f16 (an exact conversion below).
//
// Not emulated: timing, bank conflicts, registers and launch bounds (a launch's block must only
// fit them); lockstep execution (lanes run one after another between collectives, like
// independent thread scheduling); data races other than those the two orders expose; DMMA's
// internal rounding on hardware (undocumented: GPU tests compare with tolerances); out-of-bounds
// global accesses (not trapped); __restrict__ and __ldg's read-only promise (not checked).
//
// Configurations: every (D in 32/64/96/128) x (input bf16/fp16/fp32/fp64) is a separate
// compile of cov_gram.cu with the macros gram_cuda.defines() sets (FS_COV_ROWS, FS_COV_MIN_BLOCKS
// per (D, dtype); tests compare cov_gram_configs() with it), each inside a namespace of its own
// and with its entry points renamed (their C names would otherwise collide), so the file's
// constexpr tables and inline functions, which differ per configuration, never meet (no ODR
// clash). Cost: a fiber switch (swapcontext, ~0.3 µs) per thread and collective; at D = 128 a
// 16-row tile is 73 collectives per thread (68 DMMAs, 2 votes, 3 barriers per warp or block), ~5 ms
// per tile and block. The reduce kernel has no collective: ~1 µs per thread. Without <ucontext.h>
// the configurations are not compiled and cov_gram_launch throws.
#include "cov_gram_host.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if __has_include(<ucontext.h>)
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#define FS_COV_FIBERS 1
#else
#define FS_COV_FIBERS 0
#endif

#if FS_COV_FIBERS
// The dynamic shared memory of every configuration's kernel (its `extern __shared__ double smem[]`
// names this array: a block-scope extern in an extern "C" function has C linkage). One per OS
// thread; large enough for the largest configuration (D = 128, float64 input: 2 x 32 x 132 doubles).
constexpr size_t kTwinSharedDoubles = size_t(12) << 10;  // 96 KiB
extern "C" {
thread_local double smem[kTwinSharedDoubles];
}
#endif

namespace fastspec_twin {

struct Dim3 {
  unsigned x, y, z;
};

// Exact fp16 -> fp32 (what cvt.f32.f16 does): normal, subnormal (renormalized), zero, ±Inf, NaN.
inline float half_to_float(unsigned short h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);  // ±Inf; NaN made quiet
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);  // exponent bias 15 -> 127
  } else if (m == 0) {
    bits = sign;
  } else {  // m 2^-24: shift the leading one into the implicit bit
    int shift = 0;
    while (!(m & 0x400u)) {
      m <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if FS_COV_FIBERS

constexpr int kMaxBlockThreads = 1024;
constexpr size_t kStack = size_t(128) << 10;  // a thread's stack (the kernel's frame is a few KB)

// The software GPU: runs a grid block by block, a block's threads as fibers on one OS thread.
class Gpu {
 public:
  Gpu(Dim3 block, size_t smem_bytes, int order, void (*entry)(const int64_t*), const int64_t* args)
      : n_(int(block.x * block.y * block.z)), reverse_(order == 1), smem_doubles_(smem_bytes / sizeof(double)),
        entry_(entry), args_(args), ctx_(size_t(n_)), state_(size_t(n_)), tid_(size_t(n_)),
        warps_(size_t((n_ + 31) / 32)) {
    block_dim_ = block;
    for (int t = 0; t < n_; ++t)
      tid_[size_t(t)] = Dim3{unsigned(t) % block.x, unsigned(t) / block.x % block.y, unsigned(t) / (block.x * block.y)};
    for (size_t w = 0; w < warps_.size(); ++w) warps_[w].lanes = std::min(32, n_ - 32 * int(w));
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    for (int t = 0; t < n_; ++t) {
      // the lowest page is a guard: an overflow faults instead of writing over another thread's stack
      void* s = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (s == MAP_FAILED) throw std::runtime_error("cov_gram twin: no memory for a thread's stack");
      stacks_.push_back(s);
      if (mprotect(s, page, PROT_NONE) != 0) throw std::runtime_error("cov_gram twin: mprotect failed");
      getcontext(&ctx_[size_t(t)]);  // once: every block's makecontext reuses it
    }
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  ~Gpu() {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    for (void* s : stacks_) munmap(s, kStack + page);
  }

  // every block of the grid, in order; throws when a block fails
  void launch(Dim3 grid);

  // the running thread's built-ins and collectives
  const Dim3& thread_idx() const { return tid_[size_t(current_)]; }
  const Dim3& block_idx() const { return block_idx_; }
  const Dim3& block_dim() const { return block_dim_; }
  const Dim3& grid_dim() const { return grid_dim_; }
  void syncthreads();
  int all_sync(unsigned mask, int pred);
  void mma(double (&c)[2], double a, double b);

  fastspec::CovGramStats stats;

 private:
  enum State : unsigned char { kReady, kAtBarrier, kAtWarp, kDone };
  enum Op : int { kNone, kVote, kMma };
  struct Warp {
    int lanes = 32, arrived = 0, exited = 0, op = kNone;
    int vote = 0;  // the resolved __all_sync
    int pred[32];
    double a[32], b[32];
    double* c[32];  // the lanes' accumulator pairs, written in place
  };

  static void trampoline();
  void run_block();
  [[noreturn]] void fail(const std::string& why);
  [[noreturn]] void exit_thread();
  Warp& arrive(int op, const char* name);
  void wait_here();
  int next_ready(int from) const;
  void release_barrier();
  std::string where() const;

  const int n_;
  const bool reverse_;
  const size_t smem_doubles_;
  void (*const entry_)(const int64_t*);
  const int64_t* const args_;
  std::vector<ucontext_t> ctx_;
  std::vector<State> state_;
  std::vector<Dim3> tid_;
  std::vector<Warp> warps_;
  std::vector<void*> stacks_;
  ucontext_t main_{};
  Dim3 block_idx_{}, block_dim_{}, grid_dim_{};
  int current_ = 0, alive_ = 0, at_barrier_ = 0;
  std::string error_;
};

thread_local Gpu* tls_gpu = nullptr;  // the software GPU running on this OS thread

constexpr uint64_t kPoison = 0x7ff8dead0000beefull;  // a quiet NaN: "uninitialized shared memory"
constexpr uint64_t kCanary = 0x7ff8c0ffee00c0deull;  // past the launch's dynamic shared memory

void Gpu::launch(Dim3 grid) {
  grid_dim_ = grid;
  Gpu* const outer = tls_gpu;
  tls_gpu = this;
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          block_idx_ = Dim3{x, y, z};
          run_block();
        }
  } catch (...) {
    tls_gpu = outer;
    throw;
  }
  tls_gpu = outer;
}

void Gpu::run_block() {
  uint64_t* const words = reinterpret_cast<uint64_t*>(smem);
  for (size_t i = 0; i < kTwinSharedDoubles; ++i) words[i] = i < smem_doubles_ ? kPoison : kCanary;
  for (int t = 0; t < n_; ++t) {
    state_[size_t(t)] = kReady;
    ucontext_t& c = ctx_[size_t(t)];
    c.uc_stack.ss_sp = static_cast<char*>(stacks_[size_t(t)]) + sysconf(_SC_PAGESIZE);
    c.uc_stack.ss_size = kStack;
    c.uc_link = &main_;
    makecontext(&c, &Gpu::trampoline, 0);
  }
  for (Warp& w : warps_) w.arrived = w.exited = 0;
  alive_ = n_;
  at_barrier_ = 0;
  error_.clear();
  current_ = reverse_ ? n_ - 1 : 0;
  swapcontext(&main_, &ctx_[size_t(current_)]);  // back here when every thread has exited, or on failure
  if (!error_.empty()) throw std::runtime_error(error_);
  for (size_t i = smem_doubles_; i < kTwinSharedDoubles; ++i)
    if (words[i] != kCanary)
      throw std::runtime_error("cov_gram twin: block " + where() + " wrote past its " +
                               std::to_string(smem_doubles_ * sizeof(double)) +
                               " bytes of dynamic shared memory (double " + std::to_string(i) + ")");
  ++stats.blocks;
}

std::string Gpu::where() const {
  return "(" + std::to_string(block_idx_.x) + ", " + std::to_string(block_idx_.y) + ", " +
         std::to_string(block_idx_.z) + ")";
}

void Gpu::trampoline() {
  Gpu* const g = tls_gpu;
  g->entry_(g->args_);
  g->exit_thread();
}

void Gpu::fail(const std::string& why) {
  error_ = "cov_gram twin: block " + where() + ", thread " + std::to_string(current_) + ": " + why;
  setcontext(&main_);  // the block's fibers are abandoned (the kernel's frames own nothing)
  std::abort();
}

int Gpu::next_ready(int from) const {
  const int step = reverse_ ? n_ - 1 : 1;  // -1 mod n
  for (int k = 0, i = from; k < n_; ++k) {
    i = (i + step) % n_;
    if (state_[size_t(i)] == kReady) return i;
  }
  return -1;
}

void Gpu::wait_here() {
  const int from = current_;
  const int to = next_ready(from);
  if (to < 0)
    fail("deadlock: no thread can go on (" + std::to_string(at_barrier_) + " of " + std::to_string(alive_) +
         " live threads at __syncthreads, the others at warp collectives)");
  current_ = to;
  ++stats.switches;
  swapcontext(&ctx_[size_t(from)], &ctx_[size_t(to)]);  // back here once released; current_ is `from` again
}

void Gpu::exit_thread() {
  const int me = current_;
  state_[size_t(me)] = kDone;
  --alive_;
  Warp& w = warps_[size_t(me / 32)];
  ++w.exited;
  if (w.arrived > 0) fail("exited while lanes of its warp wait at a warp collective");
  if (alive_ == 0) setcontext(&main_);
  if (at_barrier_ > 0 && at_barrier_ == alive_) release_barrier();  // exited threads do not hold the barrier
  const int to = next_ready(me);
  if (to < 0) fail("deadlock after this thread's exit: the others wait at a collective it never reached");
  current_ = to;
  ++stats.switches;
  setcontext(&ctx_[size_t(to)]);
  std::abort();
}

void Gpu::release_barrier() {
  for (State& s : state_)
    if (s == kAtBarrier) s = kReady;
  at_barrier_ = 0;
  ++stats.syncthreads;
}

void Gpu::syncthreads() {
  state_[size_t(current_)] = kAtBarrier;
  if (++at_barrier_ == alive_) {
    release_barrier();  // the last to arrive goes on
    return;
  }
  wait_here();
}

Gpu::Warp& Gpu::arrive(int op, const char* name) {
  Warp& w = warps_[size_t(current_ / 32)];
  if (w.exited) fail(std::string(name) + ": a lane of this warp has exited");
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fail(std::string(name) + ": other lanes of this warp wait at another collective");
  }
  state_[size_t(current_)] = kAtWarp;
  return w;
}

int Gpu::all_sync(unsigned mask, int pred) {
  Warp& w = arrive(kVote, "__all_sync");
  const unsigned all = w.lanes == 32 ? 0xffffffffu : (1u << w.lanes) - 1u;
  if (mask != all) fail("__all_sync: the twin takes the full mask of the warp only");
  w.pred[current_ % 32] = pred;
  if (++w.arrived == w.lanes) {
    int v = 1;
    for (int l = 0; l < w.lanes; ++l) v = v && w.pred[l];
    w.vote = v;  // read by each lane when it resumes: before any of them can resolve the warp's next collective
    for (int l = 0; l < w.lanes; ++l) state_[size_t(current_ / 32 * 32 + l)] = kReady;
    w.arrived = 0;
    ++stats.all_sync;
  } else {
    wait_here();
  }
  return w.vote;
}

// A product rounded on its own (never fused into the following add).
inline double product(double a, double b) {
  volatile double p = a * b;
  return p;
}

void Gpu::mma(double (&c)[2], double a, double b) {
  Warp& w = arrive(kMma, "mma.m8n8k4");
  if (w.lanes != 32) fail("mma.m8n8k4: needs a full warp");
  const int lane = current_ % 32;
  w.a[lane] = a;
  w.b[lane] = b;
  w.c[lane] = c;
  if (++w.arrived < 32) {
    wait_here();
    return;
  }
  // the PTX ISA's fragments of mma.m8n8k4 .f64 (9.7.14.5.2): lane l holds A[l >> 2][l & 3],
  // B[l & 3][l >> 2], C and D [l >> 2][2 (l & 3) + v]
  double A[8][4], B[4][8];
  for (int l = 0; l < 32; ++l) {
    A[l >> 2][l & 3] = w.a[l];
    B[l & 3][l >> 2] = w.b[l];
  }
  for (int l = 0; l < 32; ++l)
    for (int v = 0; v < 2; ++v) {
      const int m = l >> 2, n = 2 * (l & 3) + v;
      double d = w.c[l][v];
      for (int k = 0; k < 4; ++k) d = d + product(A[m][k], B[k][n]);
      w.c[l][v] = d;
    }
  for (int l = 0; l < 32; ++l) state_[size_t(current_ / 32 * 32 + l)] = kReady;
  w.arrived = 0;
  ++stats.mma;
}

// --- the CUDA built-ins cov_gram.cu uses, for the running fiber ---------------------------------

inline const Dim3& thread_idx() { return tls_gpu->thread_idx(); }
inline const Dim3& block_idx() { return tls_gpu->block_idx(); }
inline const Dim3& block_dim() { return tls_gpu->block_dim(); }
inline const Dim3& grid_dim() { return tls_gpu->grid_dim(); }
inline void __syncthreads() { tls_gpu->syncthreads(); }
inline int __all_sync(unsigned mask, int pred) { return tls_gpu->all_sync(mask, pred); }
inline void mma_m8n8k4_f64(double (&c)[2], double a, double b) { tls_gpu->mma(c, a, b); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline int __double2hiint(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return static_cast<int>(static_cast<uint32_t>(u >> 32));
}
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
using std::sqrt;

// One configuration's two entry points, taking the launch's parameter list.
struct Kernels {
  fastspec::CovGramConfig config;
  void (*entry[2])(const int64_t*);
};

#endif  // FS_COV_FIBERS

}  // namespace fastspec_twin

#if FS_COV_FIBERS

// cov_gram.cu's CUDA spellings on the host (the included code only; defined after every header)
#define FS_COV_HOST 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ thread_local
#define threadIdx (::fastspec_twin::thread_idx())
#define blockIdx (::fastspec_twin::block_idx())
#define blockDim (::fastspec_twin::block_dim())
#define gridDim (::fastspec_twin::grid_dim())
// unique C names of each configuration's entry points
#define FS_TWIN_CAT_(a, b, c, d) a##b##c##d
#define FS_TWIN_CAT(a, b, c, d) FS_TWIN_CAT_(a, b, c, d)
#define fastspec_cov_gram FS_TWIN_CAT(fastspec_cov_gram_twin_d, FS_COV_D, _in, FS_COV_IN)
#define fastspec_cov_gram_reduce FS_TWIN_CAT(fastspec_cov_gram_reduce_twin_d, FS_COV_D, _in, FS_COV_IN)
#define FS_COV_THREADS 256

// After each inclusion: the entry points unpacking a launch's parameter list (cov_gram.cu's
// parameter lists; gram_cuda.launch_args and reduce_args pack them).
#define FS_TWIN_ENTRIES                                                                                            \
  void gram(const int64_t* a) {                                                                                    \
    fastspec_cov_gram(reinterpret_cast<const Raw*>(a[0]), reinterpret_cast<const unsigned char*>(a[1]),            \
                      reinterpret_cast<double*>(a[2]), reinterpret_cast<long long*>(a[3]), a[4], a[5], a[6], a[7], \
                      a[8], a[9], a[10], a[11], a[12], a[13]);                                                     \
  }                                                                                                                \
  void reduce(const int64_t* a) {                                                                                  \
    fastspec_cov_gram_reduce(reinterpret_cast<const double*>(a[0]), reinterpret_cast<const long long*>(a[1]), a[2], \
                             reinterpret_cast<double*>(a[3]), reinterpret_cast<double*>(a[4]),                     \
                             reinterpret_cast<double*>(a[5]), reinterpret_cast<long long*>(a[6]),                  \
                             reinterpret_cast<long long*>(a[7]), static_cast<int>(a[8]));                          \
  }                                                                                                                \
  const Kernels kernels{{FS_COV_D, FS_COV_IN, FS_COV_ROWS, FS_COV_THREADS, FS_COV_MIN_BLOCKS}, {&gram, &reduce}};

namespace fastspec_twin {

// The configurations, as gram_cuda.defines() sets them: FS_COV_ROWS 16 at D = 128 (32 with float64
// input), else 32; FS_COV_MIN_BLOCKS 1 at D = 128 with float64 input, else 2.
#define FS_COV_D 32
#define FS_COV_ROWS 32
#define FS_COV_MIN_BLOCKS 2
#define FS_COV_IN 0
namespace d32_in0 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d32_in0
#undef FS_COV_IN
#define FS_COV_IN 1
namespace d32_in1 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d32_in1
#undef FS_COV_IN
#define FS_COV_IN 2
namespace d32_in2 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d32_in2
#undef FS_COV_IN
#define FS_COV_IN 3
namespace d32_in3 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d32_in3
#undef FS_COV_IN
#undef FS_COV_D

#define FS_COV_D 64
#define FS_COV_IN 0
namespace d64_in0 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d64_in0
#undef FS_COV_IN
#define FS_COV_IN 1
namespace d64_in1 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d64_in1
#undef FS_COV_IN
#define FS_COV_IN 2
namespace d64_in2 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d64_in2
#undef FS_COV_IN
#define FS_COV_IN 3
namespace d64_in3 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d64_in3
#undef FS_COV_IN
#undef FS_COV_D

#define FS_COV_D 96
#define FS_COV_IN 0
namespace d96_in0 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d96_in0
#undef FS_COV_IN
#define FS_COV_IN 1
namespace d96_in1 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d96_in1
#undef FS_COV_IN
#define FS_COV_IN 2
namespace d96_in2 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d96_in2
#undef FS_COV_IN
#define FS_COV_IN 3
namespace d96_in3 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d96_in3
#undef FS_COV_IN
#undef FS_COV_D
#undef FS_COV_ROWS

#define FS_COV_D 128
#define FS_COV_ROWS 16
#define FS_COV_IN 0
namespace d128_in0 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d128_in0
#undef FS_COV_IN
#define FS_COV_IN 1
namespace d128_in1 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d128_in1
#undef FS_COV_IN
#define FS_COV_IN 2
namespace d128_in2 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d128_in2
#undef FS_COV_IN
#undef FS_COV_ROWS
#undef FS_COV_MIN_BLOCKS
#define FS_COV_ROWS 32
#define FS_COV_MIN_BLOCKS 1
#define FS_COV_IN 3
namespace d128_in3 {
#include "cov_gram.cu"
FS_TWIN_ENTRIES
}  // namespace d128_in3
#undef FS_COV_IN
#undef FS_COV_D
#undef FS_COV_ROWS
#undef FS_COV_MIN_BLOCKS

const Kernels* const kAll[] = {&d32_in0::kernels,  &d32_in1::kernels,  &d32_in2::kernels,  &d32_in3::kernels,
                               &d64_in0::kernels,  &d64_in1::kernels,  &d64_in2::kernels,  &d64_in3::kernels,
                               &d96_in0::kernels,  &d96_in1::kernels,  &d96_in2::kernels,  &d96_in3::kernels,
                               &d128_in0::kernels, &d128_in1::kernels, &d128_in2::kernels, &d128_in3::kernels};

}  // namespace fastspec_twin

#endif  // FS_COV_FIBERS

namespace fastspec {

#if FS_COV_FIBERS
const bool kCovGramTwin = true;

std::vector<CovGramConfig> cov_gram_configs() {
  std::vector<CovGramConfig> out;
  for (const fastspec_twin::Kernels* k : fastspec_twin::kAll) out.push_back(k->config);
  return out;
}

CovGramStats cov_gram_launch(int entry, const CovGramConfig& config, const int64_t grid[3], const int64_t block[3],
                             int64_t smem, const std::vector<int64_t>& args, int order) {
  using fastspec_twin::kAll;
  const fastspec_twin::Kernels* found = nullptr;
  for (const fastspec_twin::Kernels* k : kAll)
    if (k->config.d == config.d && k->config.in == config.in) found = k;
  const auto macros = [](const CovGramConfig& c) {
    return "FS_COV_D=" + std::to_string(c.d) + " FS_COV_IN=" + std::to_string(c.in) + " FS_COV_ROWS=" +
           std::to_string(c.rows) + " FS_COV_THREADS=" + std::to_string(c.threads) +
           " FS_COV_MIN_BLOCKS=" + std::to_string(c.min_blocks);
  };
  if (found == nullptr || found->config.rows != config.rows || found->config.threads != config.threads ||
      found->config.min_blocks != config.min_blocks)
    throw std::invalid_argument("cov_gram twin: no configuration compiled with " + macros(config) +
                                (found ? " (the build has " + macros(found->config) + "; rebuild the extension)" : ""));
  if (entry != kCovGramEntry && entry != kCovGramReduceEntry)
    throw std::invalid_argument("cov_gram twin: entry must be 0 (fastspec_cov_gram) or 1 (fastspec_cov_gram_reduce)");
  const size_t nargs = entry == kCovGramEntry ? 14 : 9;
  if (args.size() != nargs)
    throw std::invalid_argument("cov_gram twin: the entry takes " + std::to_string(nargs) + " parameters, got " +
                                std::to_string(args.size()));
  for (int i = 0; i < 3; ++i)
    if (grid[i] < 1 || grid[i] > 0x7fffffff || block[i] < 1)
      throw std::invalid_argument("cov_gram twin: grid and block dimensions must be positive");
  const int64_t threads = block[0] * block[1] * block[2];
  const int64_t bound = entry == kCovGramEntry ? config.threads : 256;  // the entries' __launch_bounds__
  if (threads > bound || threads > fastspec_twin::kMaxBlockThreads)
    throw std::invalid_argument("cov_gram twin: " + std::to_string(threads) + " threads per block, the entry's " +
                                "launch bounds allow " + std::to_string(bound));
  if (smem < 0 || size_t(smem) > kTwinSharedDoubles * sizeof(double))
    throw std::invalid_argument("cov_gram twin: dynamic shared memory of " + std::to_string(smem) +
                                " bytes, the twin has " + std::to_string(kTwinSharedDoubles * sizeof(double)));
  if (order != 0 && order != 1) throw std::invalid_argument("cov_gram twin: order must be 0 or 1");
  const fastspec_twin::Dim3 b{unsigned(block[0]), unsigned(block[1]), unsigned(block[2])};
  fastspec_twin::Gpu gpu(b, size_t(smem), order, found->entry[entry], args.data());
  gpu.launch(fastspec_twin::Dim3{unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2])});
  return gpu.stats;
}

#else
const bool kCovGramTwin = false;

std::vector<CovGramConfig> cov_gram_configs() { return {}; }

CovGramStats cov_gram_launch(int, const CovGramConfig&, const int64_t*, const int64_t*, int64_t,
                             const std::vector<int64_t>&, int) {
  throw std::runtime_error("the Gram kernel's host twin needs <ucontext.h> (POSIX): not available on this platform");
}
#endif  // FS_COV_FIBERS

}  // namespace fastspec
