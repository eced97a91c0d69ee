// eig_regs.h — the "regs" algorithm (FS_ALGO 2) of the batched eigensolver: the matrix lives in
// REGISTERS, two threads per column; shared memory holds only vectors (4.3 KiB at n = 128).
//
// Design envelope: float32 (the code is generic, fp64 is not offered: 64 doubles would not fit
// 128 registers), 1 <= n <= 128 (kRegsMaxN), aimed at 4096 x 128^2. Team = 2 * round_up(n, 32)
// threads (256 at n = 128): thread t owns column c = t % round_up(n, 32) (a warp = 32 consecutive
// columns of one half) and rows [h H, h H + H) of it, h = t / round_up(n, 32), H = round_up(n, 16)/2
// (64 at n = 128), in `Real a[64]` indexed only by compile-time constants (every loop over it is
// unrolled; rows >= n hold 0). Full symmetric storage, as eig_core.h. Shared memory: d, e, then a
// region with six vectors of round_up(n, 16) (u, w, x = the next reflector's column, the two halves'
// partial products A x, the published column j+1), reused by the eigenvalue stage afterwards.
// Launch bounds 256 threads x 2 blocks: <= 128 registers (NVRTC 13 for sm_90: 128, no stack, no
// local memory); 2 blocks = 16 warps per SM (the block algorithm: 3 blocks, 12 warps).
//
// Algorithm (per matrix; only the lower triangle of the input is read):
//   1. load straight into registers ((r, c) above the diagonal through its mirror (c, r); 64 loads
//      in flight per thread); max |a| and finiteness by team.max: NaN/Inf -> all-NaN output, zero
//      matrix -> zeros; exact scaling by 2^-e in registers (two products by normal powers of two,
//      so even 2^-127 and subnormal inputs scale exactly).
//   2. Householder tridiagonalization, xSYTD2 reflectors (as eig_core.h), rearranged so that each
//      reflector needs ONE team reduction and one plain barrier:
//        F  one register pass per column c >= j over its chunks of 8 rows that reach past row j (the
//           work shrinks like (n-j)^2; the first chunk is picked by a fall-through switch, so the
//           chunks run straight, without a test and reconvergence each): the pending reflector
//           j-1's update a -= u w_c + w u_c, fused with s = sum a_new x (u, w, x = column j: 128-bit
//           broadcasts). The halves' partial s go to shared memory; column j's own s is
//           x.x = alpha^2 + sigma (no reduction for sigma); the owners of column j+1 publish it.
//           Each member adds x_c s_c 2^80 (exact scaling) to the team sum x.(A x).
//        R  after the sum, on the members of half 0 with c >= j (only they need it): beta, tau,
//           inv = 1/(alpha - beta) by one MUFU each (sqrt.approx, rcp.approx: no IEEE slow
//           path), y.(A y) = (inv 2^-40)^2 x.(A x) (the 2^80 keeps x.(A x) clear of underflow
//           for any x fp32 can hold, so no guarded second sum);
//        W  with u = y - inv beta e_{j+1} (the raw column served as the product vector; the one
//           differing entry is a rank-one correction with the published column): p = tau (A y -
//           inv beta col), u.A.u from y.(A y), (A y)_{j+1} and col_{j+1}; w = p - (tau/2)(p.u) u;
//           column j+1 updated by reflector j becomes the next x (and d[j+1]); FS_SYNC.
//      2 barriers per reflector (the block algorithm: 5): the sum's and one FS_SYNC. Rounding: the
//      quadratic form u.A.u is evaluated with every term O(||A||) (y and the scaled products), so
//      its absolute error is the O(eps ||A||) of the usual dot product p.u: backward stable like
//      eig_core.h's.
//   3. eigenvalues of T (regs_eigenvalues, bisect_all's scheme): Gerschgorin interval by two
//      team.max, counts at the kGrid - 1 interior grid points, then per eigenvalue (128 of the 256
//      threads) bisection to a width of eps ||T||, with the IEEE Sturm count (no pivmin guard:
//      +-inf pivots, e^2 floored at FLT_MIN; 4.5 instructions per step instead of eig_core.h's
//      7.3); a scan that finds them ascending (else a rank sort); scaled back by 2^e.
//
// Cost model, fp32 n = 128, 8 warps per matrix (SASS of NVRTC 13 for sm_90, counted with
// benchmarks/sass.py; tests/test_eig_regs.py keeps the counts; per-matrix totals are dynamic
// counts: the SASS path lengths times how often each path runs, summed over the reflectors).
//   * chunk of 8 rows x 32 columns: 6 LDS.128 broadcasts (u, w, x) + 24 FFMA + ~1 of switch glue
//     = 31 instructions, 3.9 per element, 0.75 shared wavefronts per element, no LDS/STS of an
//     element (the block algorithm: 6.75-6.9 instructions, 2.75 wavefronts). Chunk executions
//     over all reflectors (a warp runs a chunk if one of its columns is >= j and the chunk
//     reaches past row j): 3320 -> ~103k instructions, ~20k wavefronts per matrix.
//   * per reflector and warp, every warp: the loop head (~8), the team sum (~27: 5 SHFL + 5 FADD,
//     the team's scratch addressing, STS, BAR) and the FS_SYNC + loop end (~7) -> ~43k;
//     warps running F: set-up, switch, the partial s and x_c s_c (~34; 540 warp-reflectors) ->
//     ~18k; the publication of column j+1 (~14 + 2 STS.128 per chunk, one warp per half) -> ~5k;
//     R + W on the half-0 warps with a column >= j (~83 with the fold of the 8 warp totals;
//     319 warp-reflectors) -> ~27k. Tridiagonalization ~195k instructions.
//   * eigenvalues ~48k: one count = 128 steps = 586 instructions per warp (63 LDS.128 + 1 LDS.64,
//     127 MUFU.RCP, FADD, FFMA, LEA.HI per step); the grid pass 4 warps x 1 count, bisection 4
//     warps x 17-18 counts (the cell width (hi - lo)/128 halved down to eps ||T||), the
//     ascending scan ~0.6k per warp, the Gerschgorin reductions ~0.6k.
//   * load + max + scale ~11k (the unrolled address arithmetic of 64 loads per thread).
//   => ~254k warp instructions and ~30k shared wavefronts per matrix (before this revision:
//      ~320k: two reductions on every warp per reflector, R on every member with work, IEEE
//      divisions, a guarded Sturm step of 7.3 instructions and an O(n) Gerschgorin loop on all
//      256 threads; the block algorithm: 325-330k predicted, 394k measured): issue bound at
//      ~63.5k cycles per matrix per SM (4 instructions per cycle). 4096 matrices = 31.03 per SM:
//      1.97M cycles, PREDICTED 1.00-1.13 ms on an H100 SXM (1.98-1.75 GHz) if the issue slots are
//      kept busy: the 1 ms target only at the top clock (no GPU has run it). The block algorithm
//      ran 2.2x its issue bound on an H200, latency bound at 12 warps per SM; here 16 warps per
//      SM (2 blocks x 8: the 4.3 KiB of shared memory no longer limits, the 128 registers per
//      thread do), the chunks carry 8 independent update chains and 6 independent broadcasts
//      per warp, 2 barriers per reflector instead of 5, and no IEEE-division slow paths in the
//      reflector. What stays exposed is the serial chain per reflector (F's last chunk -> sum
//      -> R's MUFUs -> W -> barrier, ~600-800 cycles of dependent latency at early j), which
//      only the other block on the SM can fill: PREDICTED ~1.0-1.5 ms, the upper end if it is
//      not hidden. What is left above 1 ms at 1.75 GHz is structural: the chunks (~103k, 40%) are
//      the floor of this layout (3 FFMA + 0.75 LDS.128 per element and reflector), the team
//      sum costs ~27 instructions on each of the 8 warps per reflector whether a warp has work or
//      not (~27k), and the bisection (~43k) is a Sturm count per halving (a faster-converging
//      iteration once an eigenvalue is isolated is the next lever).
#pragma once
#include "eig_core.h"
#undef FS_SITE_BASE
#define FS_SITE_BASE 30000  // FS_SYNC sites of this file (eig_core.h)

namespace fastspec {

constexpr int kRegsMaxN = 128;
constexpr int kRegsRows = 64;  // register rows per thread: the array a[] (indexed by constants only)
constexpr int kRegsChunk = 8;  // rows per skip decision (two 128-bit broadcasts of each vector)
constexpr int kRegsChunks = kRegsRows / kRegsChunk;
static_assert(kRegsChunks == 8, "regs: the fall-through switches of the fused pass list 8 chunks");

// Team: regs_cols(n) columns x 2 halves; thread t holds column t % regs_cols(n), rows
// [h * H, h * H + H) with h = t / regs_cols(n) and H = regs_half(n) = round_up(n, 16) / 2 (64 at
// n = 128; balanced halves below that, a multiple of 8 so chunks start 16-byte aligned).
FS_HD constexpr int regs_cols(int n) { return (n + 31) / 32 * 32; }
FS_HD constexpr int regs_threads(int n) { return 2 * regs_cols(n); }
FS_HD constexpr int regs_len(int n) { return (n + 15) / 16 * 16; }  // L: rows of both halves
FS_HD constexpr int regs_half(int n) { return regs_len(n) / 2; }     // H
// [d, e: round_up4(n) each] then one region used twice: during the tridiagonalization six vectors
// of L (u, w, x, p0, p1, col), during the eigenvalue stage the (e^2, d) pairs (2 round_up4(n)),
// the eigenvalues (round_up4(n)) and the grid counts (max(round_up4(n), kGrid)). e[n - 1], unused
// by T, parks the scaling's exponent from the load to the end.
FS_HD constexpr int64_t regs_region_elems(int n) {
  return 6 * regs_len(n) > 3 * round_up4(n) + (round_up4(n) > kGrid ? round_up4(n) : kGrid)
             ? 6 * regs_len(n)
             : 3 * round_up4(n) + (round_up4(n) > kGrid ? round_up4(n) : kGrid);
}
FS_HD constexpr int64_t regs_smem_elems(int n) { return 2 * round_up4(n) + regs_region_elems(n); }
static_assert(2 * kRegsMaxN / 32 * 32 <= kMaxThreads, "regs: the team of n = kRegsMaxN exceeds FS_MAX_THREADS");
static_assert(regs_half(kRegsMaxN) <= kRegsRows, "regs: a half holds at most kRegsRows rows");

// Square root and reciprocal of the reflector: on the device one MUFU each (sqrt.approx, which
// takes a subnormal nrm2 too; rcp.approx.ftz, whose arguments beta and alpha - beta are at least
// sqrt(nrm2) >= 2^-74.5 in magnitude, normal), within 1-2 ulp and without the IEEE slow paths;
// on the host IEEE. A reflector built from them is orthogonal to O(eps), as any rounded one. Also
// the Sturm recurrence's reciprocal (MUFU.RCP; rcp(+-0) = +-inf, rcp(+-inf) = +-0, a subnormal
// flushes to a signed 0).
FS_HD float regs_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));  // subnormal x too
  return r;
#else
  return sqrtf(x);
#endif
}
FS_HD float regs_rcp(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}
FS_HD double regs_sqrt(double x) { return sqrt(x); }
FS_HD double regs_rcp(double x) { return 1.0 / x; }
// 1 if the sign bit of q is set, -0 included. Device: the sign bit (one LEA.HI with the add).
FS_HD int regs_signbit(float q) {
#if defined(__CUDA_ARCH__)
  return static_cast<int>(__float_as_uint(q) >> 31);
#else
  return std::signbit(q) ? 1 : 0;
#endif
}
FS_HD int regs_signbit(double q) {
#if defined(__CUDA_ARCH__)
  return static_cast<int>(static_cast<unsigned long long>(__double_as_longlong(q)) >> 63);
#else
  return std::signbit(q) ? 1 : 0;
#endif
}

// Number of eigenvalues of T smaller than x by the IEEE recurrence (Kahan; Demmel, Dhillon and
// Ren 1995): no pivmin guard. A zero pivot gives -e2/(+-0) = -+inf for the next, whose own
// successor gets -e2/(-+inf) = +-0: the pair counts exactly one negative, as for a tiny pivot of
// either sign (the sign bit decides, so -0 counts as negative and +0 does not, both right).
// NaN-free because every e2 is at least FLT_MIN (regs_eigenvalues floors it: a change of |e|
// below 2^-63, against ||T|| >= 1/2 after the scaling). Backward stable like the guarded
// count; monotone in x only up to rounding, as that one (bisect_all's notes apply).
// pairs: (e_{i-1}^2, d_i) at pairs[2 (i - 1)], i = 1..n-1 (the pairs of steps i, i + 1, i odd,
// are one 16-byte aligned 128-bit broadcast); d0 = d_0. One step: FADD, MUFU.RCP, FFMA, LEA.HI
// and half an LDS.128.
template <class Real>
FS_HD int regs_count(const Real* pairs, Real d0, int n, Real x) {
  Real q = d0 - x;
  int count = regs_signbit(q);
  int i = 1;
FS_PRAGMA(unroll)
  for (; i + 1 < n; i += 2) {
    Real e2a, da, e2b, db;
    load4(pairs + 2 * (i - 1), e2a, da, e2b, db);
    q = Num<Real>::fma_(-e2a, regs_rcp(q), da - x);
    count += regs_signbit(q);
    q = Num<Real>::fma_(-e2b, regs_rcp(q), db - x);
    count += regs_signbit(q);
  }
  if (i < n) {
    Real e2a, da;
    load2(pairs + 2 * (i - 1), e2a, da);
    q = Num<Real>::fma_(-e2a, regs_rcp(q), da - x);
    count += regs_signbit(q);
  }
  return count;
}

// Eigenvalues of T (d, e in shared memory, complete) into out[0..n-1], ascending, scaled by 2^ex
// (ex in e[n - 1], a spare entry).
// As eig_core.h's bisect_all (a team-wide count at the kGrid - 1 interior points of the
// Gerschgorin interval, then one bisection per eigenvalue to a width of eps ||T||, a rank sort),
// but: the Gerschgorin interval by two team.max (not an O(n) loop on every member), the IEEE
// count above (4.5 instructions per step instead of 7.3), a scan that usually finds the
// eigenvalues ascending already (the rank sort only if not), and out written directly (no
// barrier after it: the next matrix writes shared memory only after its team.max).
// Buffers in `region`: the pairs (2 round_up4(n)), lam (round_up4(n)), counts (max(round_up4(n), kGrid)).
template <class Team, class Real>
FS_HD void regs_eigenvalues(const Team& team, int n, const Real* d, const Real* e, Real* region, Real* out) {
  typedef Num<Real> N;
  const int t = team.rank(), n4 = static_cast<int>(round_up4(n));
  Real* pairs = region;
  Real* lam = region + 2 * n4;
  Real* counts = lam + n4;
  FS_PHASE(team, kPhaseIsolate);
  Real hi_t = -N::huge(), nlo_t = -N::huge();
  if (t < n) {
    const Real dt = d[t];
    const Real em = t > 0 ? e[t - 1] : Real(0), ep = t + 1 < n ? e[t] : Real(0);
    const Real radius = N::abs_(em) + N::abs_(ep);
    hi_t = dt + radius;
    nlo_t = radius - dt;
    if (t > 0) {
      const Real e2 = em * em;
      pairs[2 * (t - 1)] = e2 > N::tiny() ? e2 : N::tiny();
      pairs[2 * (t - 1) + 1] = dt;
    }
  }
  const Real d0 = d[0];
  const Real eps = N::eps();
  Real hi = team.max(hi_t);  // the reductions' barriers also publish the pairs
  Real lo = -team.max(nlo_t);
  const Real tnorm = N::abs_(lo) > N::abs_(hi) ? N::abs_(lo) : N::abs_(hi);
  const Real widen = Real(2.1) * (tnorm * eps * n + 2 * N::tiny());  // xSTEBZ's margin
  lo -= widen;
  hi += widen;
  const Real tol = eps * tnorm;  // final interval width: error <= eps/2 * ||T||
  for (int g = 1 + t; g < kGrid; g += team.size())
    counts[g] = Real(regs_count(pairs, d0, n, grid_point(lo, hi, g)));
  FS_SYNC(team);
  FS_PHASE(team, kPhaseRefine);
  for (int k = t; k < n; k += team.size())  // k-th smallest eigenvalue (eig_core.h's bisection)
    lam[k] = bisect_from_grid(k, counts, lo, hi, tol, [&](Real x) { return regs_count(pairs, d0, n, x); });
  FS_SYNC(team);
  FS_PHASE(team, kPhaseSort);
  // ascending already (the usual case: a scan of lam, ~5 instructions per entry and warp) or a
  // rank sort (rounding may swap neighbours): position = #smaller + #equal before k
  const int ex = static_cast<int>(e[n - 1]);  // the scaling's exponent, parked there
  for (int k = t; k < n; k += team.size()) {
    bool sorted = true;
    for (int i = 0; i + 1 < n; ++i) sorted = sorted && lam[i] <= lam[i + 1];
    const Real x = lam[k];
    int pos = k;
    if (!sorted) {
      pos = 0;
      for (int i = 0; i < n; ++i) pos += (lam[i] < x) || (lam[i] == x && i < k);
    }
    out[pos] = N::ldexp_(x, ex);
  }
}

// One chunk of the fused pass (rows r = row0 + 8K .. + 7 of this thread's column c): reflector
// j-1's update a -= u w_c + w u_c, then s += a_new x (four accumulators).
template <int K, class Real>
FS_HD void regs_chunk(Real (&a)[kRegsRows], const Real* U, const Real* W, const Real* X, int row0, int H, Real uc,
                      Real wc, Real& s0, Real& s1, Real& s2, Real& s3) {
  if (K * kRegsChunk < H) {  // a compile-time constant on the device (n is)
    const int r = row0 + K * kRegsChunk;
    Real u[8], w[8], x[8];
    load4(U + r, u[0], u[1], u[2], u[3]);
    load4(U + r + 4, u[4], u[5], u[6], u[7]);
    load4(W + r, w[0], w[1], w[2], w[3]);
    load4(W + r + 4, w[4], w[5], w[6], w[7]);
    load4(X + r, x[0], x[1], x[2], x[3]);
    load4(X + r + 4, x[4], x[5], x[6], x[7]);
FS_PRAGMA(unroll)
    for (int m = 0; m < 8; ++m) {
      Real& y = a[K * kRegsChunk + m];
      y = Num<Real>::fma_(-w[m], uc, Num<Real>::fma_(-u[m], wc, y));
      if (m % 4 == 0) s0 = Num<Real>::fma_(y, x[m], s0);
      else if (m % 4 == 1) s1 = Num<Real>::fma_(y, x[m], s1);
      else if (m % 4 == 2) s2 = Num<Real>::fma_(y, x[m], s2);
      else s3 = Num<Real>::fma_(y, x[m], s3);
    }
  }
}

// Column publication, chunk K: rows row0 + 8K .. + 7 of this thread's column into C.
template <int K, class Real>
FS_HD void regs_publish(const Real (&a)[kRegsRows], Real* C, int row0, int H) {
  if (K * kRegsChunk < H) {
    store4(C + row0 + K * kRegsChunk, a[8 * K], a[8 * K + 1], a[8 * K + 2], a[8 * K + 3]);
    store4(C + row0 + K * kRegsChunk + 4, a[8 * K + 4], a[8 * K + 5], a[8 * K + 6], a[8 * K + 7]);
  }
}

template <class Team, class Real>
FS_HD void regs_eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  typedef Num<Real> N;
  const int nc = regs_cols(n), H = regs_half(n), L = regs_len(n);
  const int t = team.rank(), c = t % nc, h = t / nc, row0 = h * H;
  const int n4 = static_cast<int>(round_up4(n));
  // shared memory, every pointer derived from smem (LDS/STS on the device)
  Real* d = smem;
  Real* e = smem + n4;
  Real* region = smem + 2 * n4;
  Real* U = region;          // u of the pending reflector (0 on rows below its first row, >= n)
  Real* W = region + L;      // its w = p - (tau/2)(p.u) u (same zeros)
  Real* X = region + 2 * L;  // column j after every earlier reflector, 0 on rows <= j and >= n
  Real* P = region + 3 * L;  // p0, p1: the two halves' partial products A X (p1 = p0 + L)
  Real* C = region + 5 * L;  // column j + 1 of the trailing matrix, published by its owners

  // ---- 1. load: thread (c, h) reads its rows of column c; (r, c) above the diagonal is read as
  // its mirror (c, r), so only the lower triangle is touched. All 64 loads are issued before the
  // first use: 64 global loads in flight per thread. Rows / columns >= n hold 0.
  FS_PHASE(team, kPhaseLoad);
  Real a[kRegsRows];
  Real local = 0;
  if (c < n) {
    const Real* lower = in + static_cast<int64_t>(row0) * sr + static_cast<int64_t>(c) * sc;  // (row0 + i, c)
    const Real* mirror = in + static_cast<int64_t>(c) * sr + static_cast<int64_t>(row0) * sc;  // (c, row0 + i)
FS_PRAGMA(unroll)
    for (int i = 0; i < kRegsRows; ++i, lower += sr, mirror += sc)
      a[i] = i < H && row0 + i < n ? *(row0 + i >= c ? lower : mirror) : Real(0);
FS_PRAGMA(unroll)
    for (int i = 0; i < kRegsRows; ++i) {
      const Real ax = N::abs_(a[i]);
      local = (ax <= N::huge()) ? (ax > local ? ax : local) : INFINITY;  // NaN fails <=
    }
  } else {
FS_PRAGMA(unroll)
    for (int i = 0; i < kRegsRows; ++i) a[i] = 0;
  }
  const Real amax = team.max(local);
  if (!(amax <= N::huge()) || amax == 0) {  // uniform: amax is team-wide. Nothing shared written.
    const Real fill = amax == 0 ? Real(0) : N::nan_();
    for (int i = t; i < n; i += team.size()) out[i] = fill;
    FS_PHASE(team, kPhaseEnd);
    return;
  }
  // ---- 2. exact scaling by 2^s, s = -ex, as two products by normal powers of two: one rounding
  // at most (ldexp's), whatever s (scaling up never rounds; scaling down by 2^-127/2^-128 goes
  // through an exact *1/4 first, elements too small for it end at 0 either way)
  int ex = 0;
  N::frexp_(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)
  {
    const int s = -ex;
    Real f1 = 1, f2 = 1;
    if (s < N::kMinExp) { f1 = Real(0.25); f2 = N::ldexp_(Real(1), s + 2); }
    else if (s > N::kMaxExp) { f1 = N::ldexp_(Real(1), s - N::kMaxExp); f2 = N::ldexp_(Real(1), N::kMaxExp); }
    else f1 = N::ldexp_(Real(1), s);
FS_PRAGMA(unroll)
    for (int i = 0; i < kRegsRows; ++i) a[i] = (a[i] * f1) * f2;
  }

  // ---- 3. tridiagonalization. Per reflector j: F (fused register pass over columns c >= j:
  // the pending reflector j-1's rank-2 update + the partial products A x of x = X), the column
  // j+1 published; ONE team sum, of x.(A x); then R + W on the members of half 0 with c >= j:
  // reflector j from alpha = x_{j+1} and nrm2 = |x|^2 (column j's own product, (A x)_j = x.x:
  // no reduction for sigma), its u, w and column j+1 updated by it -> the next X; a barrier.
  // Two barriers per reflector: the sum's and one FS_SYNC.
  // The first X is column 0 = row 0 by symmetry, which half 0 holds in a[0] (bitwise: both are
  // the same element of the input).
  if (h == 0 && c < L) {
    U[c] = 0;  // reflector -1: the identity (u = w = 0, its update subtracts exact zeros)
    W[c] = 0;
    X[c] = c == 0 ? Real(0) : a[0];  // a[0] = 0 for c >= n
    if (c == 0) {
      d[0] = a[0];
      e[n - 1] = Real(ex);  // e's spare last entry (exact): keeps ex out of the loop's registers
    }
  }
  FS_SYNC(team);
  for (int j = 0; j + 1 < n; ++j) {  // the last reflector, n-2, is a sign flip or the identity
    FS_PHASE(team, kPhaseUpdate);
    const int j1 = j + 1;
    // F: columns c >= j, chunks of 8 rows reaching past row j (u = w = 0 and x = 0 on rows <= j
    // of the skipped ones: exact no-ops). Column j's own product is (A x)_j = sum x_r^2 = nrm2.
    // A half whose rows are all <= j has nothing to do (half 0 from j = H - 1 on): its P counts 0.
    Real q = 0;
    const bool p0 = j + 1 < H;  // half 0 still has rows > j (uniform)
    if (c >= j && c < n && row0 + H - 1 > j) {
      const Real uc = U[c], wc = W[c];
      Real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      const int m = j - row0, k0 = m < 0 ? 0 : (m + 1) >> 3;  // first chunk with a row > j
      switch (k0) {  // fall through: chunks k0..7 straight, no test and reconvergence per chunk
        case 0: regs_chunk<0>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 1: regs_chunk<1>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 2: regs_chunk<2>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 3: regs_chunk<3>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 4: regs_chunk<4>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 5: regs_chunk<5>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 6: regs_chunk<6>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); [[fallthrough]];
        case 7: regs_chunk<7>(a, U, W, X, row0, H, uc, wc, s0, s1, s2, s3); break;
        default: break;
      }
      const Real s = (s0 + s1) + (s2 + s3);
      P[h * L + c] = s;
      q = X[c] * (s * Real(0x1p80));  // x_c (A x)_c 2^80 (exact scaling); X[j] = 0
      if (c == j1) {  // column j + 1, up to date with reflector j-1: publish (rows > j suffice)
        switch (k0) {
          case 0: regs_publish<0>(a, C, row0, H); [[fallthrough]];
          case 1: regs_publish<1>(a, C, row0, H); [[fallthrough]];
          case 2: regs_publish<2>(a, C, row0, H); [[fallthrough]];
          case 3: regs_publish<3>(a, C, row0, H); [[fallthrough]];
          case 4: regs_publish<4>(a, C, row0, H); [[fallthrough]];
          case 5: regs_publish<5>(a, C, row0, H); [[fallthrough]];
          case 6: regs_publish<6>(a, C, row0, H); [[fallthrough]];
          case 7: regs_publish<7>(a, C, row0, H); break;
          default: break;
        }
      }
    }
    FS_PHASE(team, kPhaseReflector);
    const bool wm = h == 0 && c >= j && c < n;  // members of R + W
    const Real alpha = wm ? X[j1] : Real(0);  // before the sum: W below rewrites X[j1]
    const Real xAx = team.sum(q);  // x.(A x) * 2^80
    // R (xSYTD2): H = I - tau u u^T, u = [1, x[j+2:] * inv], inv = 1/(alpha - beta), y = inv x;
    // nrm2 = alpha^2 + sigma is column j's own product. y.(A y) = (inv 2^-40)^2 * xAx: with the
    // 2^80 in the sum's terms, an x as small as fp32 allows (|x|^2 >= 2^-149) leaves every term
    // normal or its underflow below 2^-72 ||A|| in y.(A y); nothing overflows (|inv| <= 2^75).
    Real beta = alpha, tau = 0, inv = 0, yAy = 0;
    if (wm) {
      const Real nrm2 = (p0 ? P[j] : Real(0)) + P[L + j];
      if (nrm2 > 0) {  // else x = 0: the identity (tau = 0, u = w = 0)
        beta = -N::copysign_(regs_sqrt(nrm2), alpha);
        tau = (beta - alpha) * regs_rcp(beta);
        inv = regs_rcp(alpha - beta);
        const Real ib = inv * Real(0x1p-40);
        yAy = (ib * ib) * xAx;
      }
    }
    // W: with u = y - ub e_{j+1} (ub = inv * beta; u_{j+1} = inv (alpha - beta) = 1) and T = A y:
    // p = tau A u = tau (T - ub col), u.A.u = y.T - 2 ub T_{j+1} + ub^2 col_{j+1}.
    if (wm) {  // c < j (and n <= c < L): u = w = x = 0 already
      if (c == j1) e[j] = beta;
      const Real ub = inv * beta;
      const Real T1 = inv * ((p0 ? P[j1] : Real(0)) + P[L + j1]), C1 = C[j1];
      const Real uAu = N::fma_(ub * ub, C1, N::fma_(Real(-2) * ub, T1, yAy));
      const Real half_tau_pu = Real(0.5) * tau * (tau * uAu);
      const Real w1 = tau * N::fma_(-ub, C1, T1) - half_tau_pu;  // w_{j+1} (every member alike)
      Real uc = 0, wc = 0, xn = 0;
      if (c > j) {
        const Real Tc = inv * ((p0 ? P[c] : Real(0)) + P[L + c]), Cc = C[c];
        uc = c == j1 ? Real(1) : inv * X[c];
        wc = tau * N::fma_(-ub, Cc, Tc) - half_tau_pu * uc;
        xn = N::fma_(-wc, Real(1), N::fma_(-uc, w1, Cc));  // F's update of (c, j+1), u_{j+1} = 1
      }
      U[c] = uc;
      W[c] = wc;
      X[c] = c > j1 ? xn : Real(0);
      if (c == j1) d[j1] = xn;
    }
    FS_SYNC(team);  // U, W, X (and d, e) complete for the next F
  }

  // ---- 4-5. eigenvalues of T, scaled back
  regs_eigenvalues(team, n, d, e, region, out);
  FS_PHASE(team, kPhaseEnd);
}

}  // namespace fastspec
