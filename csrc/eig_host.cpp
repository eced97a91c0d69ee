// eig_host.cpp — host twin: eig_core.h with a one-thread team, matrix by matrix. It exists so
// CPU-only CI tests the solver's numerics (fastspec.eigvalsh(A, solver="host")); it is not
// tuned for speed (torch's LAPACK path is the CPU solver of choice).
//
// Also here, for tests only: every algorithm of the kernel (eig_algos.h) run by a team of real
// threads with the CUDA block's size, shared-memory layout, barriers and reduction order (32-lane
// xor butterflies, warp totals folded in order, two alternating scratch halves). It checks,
// without a GPU, what the one-thread twin cannot: the rank/size-strided loops, every barrier's
// placement and the device buffer layout. Threads run freely or one at a time in a fixed order
// (deterministic), and any one barrier can be left out: the tests show that leaving out any
// barrier of an algorithm changes its results in one of the two orders.
#include "eig_host.h"

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "eig_algos.h"

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

// The emulation's schedulers. kConcurrent: real threads run freely between barriers (a reusable,
// generation-counted barrier, blocking: 2-core CI boxes cannot afford spinning). kForward and
// kReverse: one thread runs at a time, in rank order (or reversed), each from one barrier to the
// next; so the emulation is deterministic, and a barrier left out (`drop`) merges two phases the
// way a GPU may run them: a read of what another thread writes in the same phase sees it already
// written in one order and not yet in the other, so one of the two orders gives other results.
enum Schedule : int { kConcurrent = 0, kForward = 1, kReverse = 2 };

class Scheduler {
 public:
  Scheduler(int count, int schedule) : count_(count), schedule_(schedule), wake_(count), done_(count, false) {
    current_ = schedule == kReverse ? count - 1 : 0;
  }
  // a thread's first step: wait for its turn (serial schedules)
  void start(int me) {
    if (schedule_ == kConcurrent) return;
    std::unique_lock<std::mutex> lock(mu_);
    wake_[me].wait(lock, [&] { return current_ == me; });
  }
  // a barrier: every thread of the team waits here until all have arrived
  void wait(int me) {
    std::unique_lock<std::mutex> lock(mu_);
    if (schedule_ == kConcurrent) {
      const unsigned gen = gen_;
      if (++arrived_ == count_) {
        arrived_ = 0;
        ++gen_;
        all_.notify_all();
      } else {
        all_.wait(lock, [&] { return gen != gen_; });
      }
      return;
    }
    pass(me);
    wake_[me].wait(lock, [&] { return current_ == me; });
  }
  // a thread's last step
  void finish(int me) {
    if (schedule_ == kConcurrent) return;
    std::unique_lock<std::mutex> lock(mu_);
    done_[me] = true;
    pass(me);
  }

 private:
  // hand the turn to the next unfinished thread in the schedule's order (caller holds mu_)
  void pass(int me) {
    int next = me;
    for (int i = 0; i < count_; ++i) {
      next = schedule_ == kReverse ? (next + count_ - 1) % count_ : (next + 1) % count_;
      if (!done_[next]) break;
    }
    current_ = next;
    wake_[next].notify_one();
  }
  std::mutex mu_;
  std::condition_variable all_;
  int count_, schedule_, arrived_ = 0, current_ = 0;
  unsigned gen_ = 0;
  std::vector<std::condition_variable> wake_;
  std::vector<bool> done_;
};

// BlockTeam (eig_kernel.cu) on threads: same rank/size, barriers, and reduction arithmetic. The
// barriers of the algorithm (FS_SYNC) are counted; rank 0 records each one's source line, and the
// `drop`-th is skipped by every thread (the barrier-mutation check); the reductions' own barriers
// are the team's and always kept.
struct ThreadTeam {
  int me, nt;
  Scheduler* sched;
  void* scratch;  // 2 halves of kMaxLanes reals: every lane's value (a warp shuffle reads them)
  int64_t drop;  // index of the FS_SYNC barrier to leave out, -1 for none
  std::vector<int>* sites;  // rank 0: the source line of every FS_SYNC barrier, in order
  std::vector<int>* phases;  // rank 0: every FS_PHASE mark, barriers included, as the profiling build makes them
  mutable unsigned parity;
  mutable int64_t calls;
  mutable int current;  // the phase a barrier resumes
  static constexpr int kMaxLanes = kMaxThreads;  // the CUDA block's cap

  int rank() const { return me; }
  int size() const { return nt; }
  // eig_kernel.cu's BlockTeam::phase and ::barrier: a barrier is a mark of its own, then the
  // interrupted phase again
  void phase(int p) const {
    if (me == 0 && phases) phases->push_back(p);
    current = p;
  }
  void barrier() const {
    const int resume = current;
    phase(kPhaseBarrier);
    sched->wait(me);
    phase(resume);
  }
  void sync(int line = 0) const {
    if (me == 0 && sites) sites->push_back(line);
    if (calls++ == drop) return;
    barrier();
  }

  template <class Real, class Op> Real reduce(Real x, Op op) const {
    Real* s = static_cast<Real*>(scratch) + (parity++ & 1u) * kMaxLanes;
    s[me] = x;
    barrier();
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
std::vector<int> team_eigvalsh(const Real* in, Real* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                               int64_t osb, int algo, int schedule, int64_t drop, int record) {
  const int nt = algo_threads(algo, n);
  // the kernel's shared-memory layout of this algorithm; poisoned with NaN, as uninitialized
  // shared memory may hold anything: a read before the first write shows in the results
  std::vector<Real> sm(static_cast<size_t>(algo_smem_elems(algo, n)), Num<Real>::nan_());
  std::vector<Real> scratch(2 * ThreadTeam::kMaxLanes, Num<Real>::nan_());
  std::vector<int> sites, phases;
  Scheduler sched(nt, schedule);
  std::vector<std::thread> threads;
  for (int me = 0; me < nt; ++me) {
    threads.emplace_back([&, me] {
      const ThreadTeam team{me,      nt, &sched, scratch.data(), drop, me == 0 ? &sites : nullptr,
                            me == 0 ? &phases : nullptr, 0u, 0, kPhaseLoad};
      sched.start(me);
      for (int64_t b = 0; b < batch; ++b)
        algo_eigvalsh_one(algo, team, in + b * sb, sr, sc, n, out + b * osb, sm.data());
      sched.finish(me);
    });
  }
  for (auto& t : threads) t.join();
  return record == kRecordPhases ? phases : sites;
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

std::vector<int> team_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr,
                                   int64_t sc, int64_t osb, int algo, int schedule, int64_t drop, int record) {
  return team_eigvalsh(in, out, batch, n, sb, sr, sc, osb, algo, schedule, drop, record);
}

std::vector<int> team_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr,
                                   int64_t sc, int64_t osb, int algo, int schedule, int64_t drop, int record) {
  return team_eigvalsh(in, out, batch, n, sb, sr, sc, osb, algo, schedule, drop, record);
}

}  // namespace fastspec
