// eig_host.cpp — host twin: eig_core.h with a one-thread team, matrix by matrix. It exists so
// CPU-only CI tests the solver's numerics (fastspec.eigvalsh(A, solver="host")); it is not
// tuned for speed (torch's LAPACK path is the CPU solver of choice).
//
// Also here, for tests only: the same eig_core.h code run by a team of real threads with the
// CUDA kernel's team size, shared-memory layout (padded rows, 16-byte-aligned vectors of
// round_up4(n)), barriers and reduction order (32-lane xor butterflies, warp totals folded in
// order, two alternating scratch halves). It checks, without a GPU, the parts of the parallel
// algorithm the one-thread twin cannot: the rank/size-strided loops, every barrier's placement
// (a missing one is a data race here too) and the device buffer layout.
#include "eig_host.h"

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "eig_core.h"

namespace fastspec {
namespace {

template <class Real>
void host_eigvalsh(const Real* in, Real* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  std::vector<Real> buf(static_cast<size_t>(n) * n + static_cast<size_t>(work_vector_elems(n)));
  Work<Real> wk;
  wk.rs = 1;
  wk.cs = n;
  wk.a = buf.data();
  wk.d = wk.a + static_cast<size_t>(n) * n;
  wk.e = wk.d + n;
  wk.v = wk.e + n;
  wk.w = wk.v + n;
  wk.v2 = wk.w + n;
  wk.p2 = wk.v2 + n;
  const HostTeam team;
  for (int64_t b = 0; b < batch; ++b) eigvalsh_one(team, in + b * sb, sr, sc, n, out + b * osb, wk);
}

// A reusable barrier (generation counted), blocking: 2-core CI boxes cannot afford spinning.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const unsigned gen = gen_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_, arrived_ = 0;
  unsigned gen_ = 0;
};

// BlockTeam (eig_kernel.cu) on threads: same rank/size, barriers, and reduction arithmetic.
struct ThreadTeam {
  int me, nt;
  Barrier* bar;
  void* scratch;  // 2 halves of kMaxLanes reals: every lane's value (a warp shuffle reads them)
  mutable unsigned parity;
  static constexpr int kMaxLanes = kMaxThreads;  // the CUDA block's cap

  int rank() const { return me; }
  int size() const { return nt; }
  void sync() const { bar->wait(); }

  template <class Real, class Op> Real reduce(Real x, Op op) const {
    Real* s = static_cast<Real*>(scratch) + (parity++ & 1u) * kMaxLanes;
    s[me] = x;
    bar->wait();
    // what __shfl_xor_sync butterflies give every lane, then the warp totals folded in order
    Real t = 0;
    for (int w = 0; w < nt / 32; ++w) {
      Real lane[32];
      for (int l = 0; l < 32; ++l) lane[l] = s[32 * w + l];
      for (int o = 16; o > 0; o >>= 1) {
        Real next[32];
        for (int l = 0; l < 32; ++l) next[l] = op(lane[l], lane[l ^ o]);
        for (int l = 0; l < 32; ++l) lane[l] = next[l];
      }
      t = w == 0 ? lane[0] : op(t, lane[0]);
    }
    return t;
  }
  template <class Real> Real sum(Real x) const {
    return reduce(x, [](Real a, Real b) { return a + b; });
  }
  template <class Real> Real max(Real x) const {
    return reduce(x, [](Real a, Real b) { return a > b ? a : b; });
  }
};

template <class Real>
void team_eigvalsh(const Real* in, Real* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  int nt = (n + 31) / 32 * 32;
  if (nt > ThreadTeam::kMaxLanes) nt = ThreadTeam::kMaxLanes;
  // the kernel's shared-memory layout (eig_kernel.cu with the matrix in shared memory)
  std::vector<Real> sm(static_cast<size_t>(block_work_elems(n, true)));
  std::vector<Real> scratch(2 * ThreadTeam::kMaxLanes);
  const Work<Real> wk = block_work(sm.data(), static_cast<Real*>(nullptr), n);
  Barrier bar(nt);
  std::vector<std::thread> threads;
  for (int me = 0; me < nt; ++me) {
    threads.emplace_back([&, me] {
      const ThreadTeam team{me, nt, &bar, scratch.data(), 0u};
      for (int64_t b = 0; b < batch; ++b) eigvalsh_one(team, in + b * sb, sr, sc, n, out + b * osb, wk);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace

void host_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb) {
  host_eigvalsh(in, out, batch, n, sb, sr, sc, osb);
}

void host_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb) {
  host_eigvalsh(in, out, batch, n, sb, sr, sc, osb);
}

void team_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb) {
  team_eigvalsh(in, out, batch, n, sb, sr, sc, osb);
}

void team_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb) {
  team_eigvalsh(in, out, batch, n, sb, sr, sc, osb);
}

}  // namespace fastspec
