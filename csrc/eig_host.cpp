// eig_host.cpp — host twin: eig_core.h with a one-thread team, matrix by matrix. It exists so
// CPU-only CI tests the solver's numerics (fastspec.eigvalsh(A, solver="host")); it is not
// tuned for speed (torch's LAPACK path is the CPU solver of choice).
//
// Also here, for tests only: every algorithm of the kernel (eig_algos.h) run by a team of ranks
// (fibers, on one or two OS threads) with the CUDA block's size, shared-memory layout, barriers
// and reduction order (32-lane xor butterflies, warp totals folded in order, two alternating
// scratch halves). It checks, without a GPU, what the one-thread twin cannot: the
// rank/size-strided loops, every barrier's placement and the device buffer layout. Ranks run on
// two OS threads at once, or one at a time in a fixed order (deterministic), and any one barrier
// can be left out: the tests show that leaving out any barrier of an algorithm changes its
// results in one of the two orders.
#include "eig_host.h"

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#if __has_include(<ucontext.h>)
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#define FS_FIBERS 1
#else
#define FS_FIBERS 0
#endif

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

// The emulation's schedulers. The team's ranks are fibers (ucontext), not OS threads: a switch
// between two costs ~0.25 µs where a hand-over between OS threads (a futex wake and a sleep) cost
// ~4 µs, and a 256-rank team passes ~1,000 barriers per matrix, so on threads the emulation spent
// nearly all its time in switches (2-3 s for two 128 x 128 matrices; the arithmetic, as the
// one-thread twin does it, ~5 ms).
//
// kForward and kReverse: one OS thread runs every rank, one at a time, in rank order (or
// reversed), each from one barrier to the next; so the emulation is deterministic, and a barrier
// left out (`drop`) merges two phases the way a GPU may run them: a read of what another rank
// writes in the same phase sees it already written in one order and not yet in the other, so one
// of the two orders gives other results.
// kConcurrent: kLanes OS threads run freely against each other, rank r on thread r mod kLanes
// (every two neighbouring ranks of a warp run at the same time), each running its own ranks one
// after another between barriers; at a barrier the threads meet too (a reusable,
// generation-counted, blocking barrier: 2-core CI boxes cannot afford spinning).
enum Schedule : int { kConcurrent = 0, kForward = 1, kReverse = 2 };

#if FS_FIBERS
constexpr int kLanes = 2;                     // OS threads of the concurrent schedule
constexpr size_t kStack = size_t(256) << 10;  // a rank's stack (the algorithms keep a few hundred bytes there)

// The OS threads' meeting point at each barrier of the concurrent schedule.
class Meeting {
 public:
  explicit Meeting(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const unsigned gen = gen_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++gen_;
      all_.notify_all();
    } else {
      all_.wait(lock, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable all_;
  int count_, arrived_ = 0;
  unsigned gen_ = 0;
};

// One OS thread's share of the team: its ranks as fibers, in a fixed cyclic order. A rank at a
// barrier hands over to the next one still running; the last one to arrive (the last of the
// order) first meets the other lanes, so every rank of the team has arrived before any goes on.
class Lane {
 public:
  Lane(std::vector<int> ranks, Meeting* meeting)
      : ranks_(std::move(ranks)), meeting_(meeting), ctx_(ranks_.size()), done_(ranks_.size(), false),
        alive_(static_cast<int>(ranks_.size())) {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      // the lowest page is a guard: an overflow faults instead of writing over another rank's stack
      void* s = mmap(nullptr, kStack + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (s == MAP_FAILED) throw std::runtime_error("team emulation: no memory for a rank's stack");
      stacks_.push_back(s);
      if (mprotect(s, page(), PROT_NONE) != 0) throw std::runtime_error("team emulation: mprotect failed");
    }
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() {
    for (void* s : stacks_) munmap(s, kStack + page());
  }
  const std::vector<int>& ranks() const { return ranks_; }

  // run body(rank) for every rank of the lane, to its end, on the calling OS thread
  void run(const std::function<void(int)>& body) {
    if (ranks_.empty()) return;
    body_ = &body;
    const auto self = reinterpret_cast<uintptr_t>(this);
    for (size_t i = 0; i < ranks_.size(); ++i) {
      getcontext(&ctx_[i]);
      ctx_[i].uc_stack.ss_sp = static_cast<char*>(stacks_[i]) + page();
      ctx_[i].uc_stack.ss_size = kStack;
      ctx_[i].uc_link = &main_;
      // makecontext passes ints: the lane's address in two halves, then the rank's index
      makecontext(&ctx_[i], reinterpret_cast<void (*)()>(&Lane::entry), 3, static_cast<unsigned>(self >> 32),
                  static_cast<unsigned>(self & 0xffffffffu), static_cast<unsigned>(i));
    }
    at_ = 0;
    swapcontext(&main_, &ctx_[0]);  // back here when the last rank has ended
  }

  // a barrier, called by the rank running now
  void wait() {
    if (++arrived_ == alive_) round();
    const size_t from = at_;
    at_ = next(from);
    if (at_ != from) swapcontext(&ctx_[from], &ctx_[at_]);
  }

 private:
  static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

  static void entry(unsigned hi, unsigned lo, unsigned i) {
    Lane* lane = reinterpret_cast<Lane*>((static_cast<uintptr_t>(hi) << 32) | lo);
    (*lane->body_)(lane->ranks_[i]);
    lane->finish();
  }

  // every running rank of the lane has arrived: meet the other lanes; a new round begins
  void round() {
    arrived_ = 0;
    if (meeting_) meeting_->wait();
  }

  // the running rank has ended: the next one goes on, or the lane is done. (Every rank passes
  // the same barriers; were one to end while the others wait at a barrier, they go on.)
  void finish() {
    done_[at_] = true;
    if (--alive_ == 0) setcontext(&main_);
    if (arrived_ == alive_) round();
    at_ = next(at_);
    setcontext(&ctx_[at_]);
  }

  size_t next(size_t i) const {
    for (size_t k = 0; k < ranks_.size(); ++k) {
      i = (i + 1) % ranks_.size();
      if (!done_[i]) return i;
    }
    return i;
  }

  std::vector<int> ranks_;
  Meeting* meeting_;
  std::vector<ucontext_t> ctx_;
  std::vector<bool> done_;
  std::vector<void*> stacks_;
  const std::function<void(int)>* body_ = nullptr;
  ucontext_t main_{};
  size_t at_ = 0;
  int alive_, arrived_ = 0;
};

// The team: `count` ranks, spread over the schedule's lanes.
class Scheduler {
 public:
  Scheduler(int count, int schedule) : lane_of_(static_cast<size_t>(count)) {
    const int lanes = schedule == kConcurrent ? std::min(kLanes, count) : 1;
    std::vector<std::vector<int>> ranks(static_cast<size_t>(lanes));
    for (int k = 0; k < count; ++k) {
      const int r = schedule == kReverse ? count - 1 - k : k;
      ranks[static_cast<size_t>(r % lanes)].push_back(r);
    }
    if (lanes > 1) meeting_ = std::make_unique<Meeting>(lanes);
    for (auto& r : ranks) {
      lanes_.push_back(std::make_unique<Lane>(std::move(r), meeting_.get()));
      for (int rank : lanes_.back()->ranks()) lane_of_[static_cast<size_t>(rank)] = lanes_.back().get();
    }
  }
  // run body(rank) for every rank; returns when all have ended
  void run(const std::function<void(int)>& body) {
    if (lanes_.size() == 1) return lanes_[0]->run(body);
    std::vector<std::thread> threads;
    for (auto& lane : lanes_) threads.emplace_back([&lane, &body] { lane->run(body); });
    for (auto& t : threads) t.join();
  }
  // a barrier: every rank of the team waits here until all have arrived
  void wait(int me) { lane_of_[static_cast<size_t>(me)]->wait(); }

 private:
  std::unique_ptr<Meeting> meeting_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::vector<Lane*> lane_of_;
};
#endif  // FS_FIBERS

#if FS_FIBERS
// BlockTeam (eig_kernel.cu) on the emulation's ranks: same rank/size, barriers, and reduction arithmetic. The
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
#endif  // FS_FIBERS

template <class Real>
std::vector<int> team_eigvalsh(const Real* in, Real* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                               int64_t osb, int algo, int schedule, int64_t drop, int record) {
#if FS_FIBERS
  const int nt = algo_threads(algo, n);
  // the kernel's shared-memory layout of this algorithm; poisoned with NaN, as uninitialized
  // shared memory may hold anything: a read before the first write shows in the results
  std::vector<Real> sm(static_cast<size_t>(algo_smem_elems(algo, n)), Num<Real>::nan_());
  std::vector<Real> scratch(2 * ThreadTeam::kMaxLanes, Num<Real>::nan_());
  std::vector<int> sites, phases;
  Scheduler sched(nt, schedule);
  sched.run([&](int me) {
    const ThreadTeam team{me,      nt, &sched, scratch.data(), drop, me == 0 ? &sites : nullptr,
                          me == 0 ? &phases : nullptr, 0u, 0, kPhaseLoad};
    for (int64_t b = 0; b < batch; ++b) algo_eigvalsh_one(algo, team, in + b * sb, sr, sc, n, out + b * osb, sm.data());
  });
  return record == kRecordPhases ? phases : sites;
#else
  (void)in, (void)out, (void)batch, (void)n, (void)sb, (void)sr, (void)sc, (void)osb, (void)algo, (void)schedule,
      (void)drop, (void)record;
  throw std::runtime_error("the team emulation needs <ucontext.h> (POSIX): not available on this platform");
#endif
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
