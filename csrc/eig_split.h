// eig_split.h — the "split" algorithm of the batched eigensolver (FS_ALGO 3, eig_algos.h): the block
// algorithm's layout and numerics (eig_core.h) with TWO threads per column, for the LATENCY of one
// matrix when the batch is a wave or less (the probe's float64 keys solve: 256 matrices of 128 x 128
// on 132 SMs, ~2 blocks per SM, the GPU mostly idle): fewer sequential steps per matrix, not fewer
// instructions.
//
// Design envelope: float32 and float64, 1 <= n <= kSplitMaxN = 128. Team = 2T threads, T =
// round_up(n, 32) (256 at n = 128): member t is (col, half) = (t % T, t / T), so a warp is 32
// consecutive columns of one half. Shared memory: block_work (the matrix, rows padded to n + 1, then
// d, e, v, w, v2, p2), then 6T reals of its own (split_smem_elems): fp64 n = 128 141.5 KiB (1 block
// per H100 SM, 8 warps), fp32 n = 128 70.7 KiB (3 blocks, 24 warps; the launch bounds ask for 2).
//
// Algorithm (per matrix; strict upper triangle never read; NaN/Inf -> NaN, zero -> zeros, exact
// 2^-e pre-scaling, as eig_core.h):
//   1. load + mirror (each half reads every other 8-row batch of its column), team max; scaling by
//      2^-e, each half every other row.
//   2. Householder tridiagonalization, eig_core.h's reflectors and update expression; 3 barriers per
//      reflector (block: 5, plus a redundant one), two of them the reductions':
//      (a) [reduction of p.u] w = p - (tau/2)(p.u) u, the update of column j and the squared norm
//          of that column below row j + 1, one pass (every member recomputes w_j by the same
//          expression as the member of row j, so no barrier between w and the column update);
//      (b) [reduction of the norm] reflector j's beta, tau, u_next [FS_SYNC];
//      (c) the fused rank-2 update of columns > j + p of the next reflector: member (col, half)
//          walks HALF the rows of its column (block: all of them), its partial p goes to p2 (half 0)
//          or to the extra vector (half 1); p = P + Q is formed in the next (a), after its
//          reduction's barrier, and the partial (p.u) is summed there too.
//   3. Sturm bisection of T, 2 members per eigenvalue: a team-wide grid pass (2T cells: one count
//      per member, 1 bit more than the block's 128 cells), then TRISECTION: each member of the pair
//      counts at one of the two interior points, the counts meet in shared memory (double-buffered
//      by sweep parity, one barrier per sweep; the sweep count is the same on every member),
//      log2(3) = 1.58 bits per sweep: fp64 30 sweeps (block: ~46-47), fp32 11 (block: ~18).
//      fp64 Sturm step without an IEEE division (SplitSturm<double>): a MUFU.RCP64H seed r0, e = 1 -
//      q r0, q' = (t - g) - g (e + e^2), g = e2 r0: chain MUFU + 3 DFMA + guard (DSETP, FSEL); block:
//      MUFU + ~7 DFMA + the slow-path check + DADD + guard. Backward stable: each rounding is a
//      relative perturbation of e2 or of t = d - x by a few ulps (the seed's 2^-20 error enters as
//      e^3 ~ 2^-60); the host emulation models the seed (20 bits, flushed to zero), so CPU CI runs
//      this arithmetic.
//   4. rank sort (as bisect_all), scaled back, written straight to the output (no barrier after).
//
// Cost model (SASS from NVRTC 13 for sm_90, benchmarks/sass.py; tests/test_eig_split.py keeps the
// counts). Registers: fp32 56, fp64 92; no stack, no local memory, no generic LD/ST.
//   * fused update loop (8 rows per iteration): fp32 54 instructions = 6.75 per element, 24 FFMA,
//     14 LDS + 8 STS (2.75 shared instructions and wavefronts per element and warp); fp64 60 = 7.5
//     per element, 24 DFMA, 20 LDS + 8 STS (5.5 wavefronts per element and warp: the element is two
//     wavefronts each way). Summed over reflectors: ~26k warp-iterations of 1 element per lane (the
//     block's: the halves split the rows, not the work) -> fp32 ~176k instructions, ~72k wavefronts;
//     fp64 ~195k instructions, ~143k wavefronts. Per-reflector rest (2 reductions, reflector, w,
//     column, 1 FS_SYNC; all 8 warps): ~150-250 instructions per warp (estimate, not counted) ->
//     ~150-250k per matrix: the doubled team doubles it (block ~60k).
//   * Sturm step: fp32 175 instructions per 24 unrolled steps = 7.3 (LDS.64, MUFU.RCP, FADD, FFMA,
//     FSETP, FSEL, LEA.HI); fp64 162 per 12 = 13.5 (LDS.128, MUFU.RCP64H, 3 DFMA, DMUL, 2 DADD,
//     DSETP, 2 FSEL, LEA.HI count, ...). One sweep = 8 warps x 128 steps: fp32 7.5k, fp64 13.8k
//     instructions; fp32 12 passes ~90k, fp64 31 passes ~430k per matrix (trisection issues 1.26x
//     the instructions of bisection per bit: it buys latency, not throughput).
//   * CRITICAL PATH (one matrix alone on an SM, assumed latencies: DFMA/DADD 8 cycles, MUFU.RCP64H
//     ~20, DSETP + FSEL ~12, LDS ~30, a barrier ~30, a reduction ~300):
//       bisection fp64: 31 passes x 128 steps x ~56 cycles = ~220k cycles (block: 49 x 128 x ~106
//       = ~660k); fp32: 12 x 128 x ~30 = ~46k (block: 19 x 128 x ~30 = ~73k).
//       tridiagonalization: 126 reflectors x (2 reductions + 1 barrier + sqrt/div + 3 short passes
//       ~1000 cycles) = ~126k, plus the column walks, shared-bandwidth bound in fp64 (143k wavefronts
//       at 1/cycle; block: the same wavefronts, but one warp per scheduler walking all n rows).
//   * PREDICTED (no GPU has run it), H100 SXM, 132 SMs at 1.75-1.98 GHz:
//       256 x 128^2 fp64 (one wave, 124 SMs with 2 blocks = 16 warps): per SM ~290k shared cycles +
//       ~130k reflector latency (partly overlapped by the other block) + bisection ~310k (2 blocks:
//       issue bound, 4 warps x 13.5 instructions and 6 fp64-pipe ops at 2 cycles per step and
//       scheduler, ~78 cycles > the 56-cycle chain) = ~0.6-0.73M cycles: ~0.33-0.42 ms. The block
//       algorithm by the same model: ~290k + ~150k + ~660k (latency bound) = ~1.1M: ~0.55-0.63 ms.
//       4096 x 128^2 fp32 (31 matrices per SM, many waves): ~430-510k warp instructions per matrix
//       (block: 325-330k predicted, 394k measured) -> issue bound ~3.3-4.0M cycles per SM: ~1.7-2.3
//       ms. The block algorithm MEASURED 3.69 ms on an H200 at 2.2x its issue bound, latency bound
//       with 12 warps per SM; split has 24 warps per SM (3 blocks of 8), twice the candidates per
//       scheduler, so it should run nearer its (higher) issue bound: perhaps 2.3-2.8 ms. For large
//       batches the block/packed/regs candidates should win; split's target is the one-wave case.
#pragma once
#include "eig_core.h"
#undef FS_SITE_BASE
#define FS_SITE_BASE 40000  // FS_SYNC sites of this file (eig_core.h)

#if !defined(__CUDACC_RTC__) && !defined(__CUDA_ARCH__)
#include <cstring>  // the host's model of the fp64 MUFU reciprocal (bit pattern)
#endif

namespace fastspec {

constexpr int kSplitMaxN = 128;

// Columns of the team: T = round_up(n, 32); the team is two halves of T threads.
FS_HD constexpr int split_cols(int n) { return (n + 31) / 32 * 32; }
FS_HD constexpr int split_threads(int n) { return 2 * split_cols(n); }
// block_work (matrix with padded rows, d, e, v, w, v2, p2), then 6 T reals of this algorithm's
// own: [0, T) the second half's partial p (tridiagonalization), later [0, 2T) the bisection's grid
// counts; [2T, 6T) the two sweeps' counts of every thread (double-buffered by sweep parity).
FS_HD constexpr int64_t split_smem_elems(int n) { return block_work_elems(n, true) + 6 * split_cols(n); }

// One step of the Sturm recurrence q' = (d - x) - e2 / q, for eig_core.h's sturm_count.
// float: eig_core.h's (MUFU reciprocal and a multiply). double: no IEEE division (a MUFU.RCP64H
// seed r0 with ~20 good bits, then e = 1 - q r0 and q' = (t - g) - g (e + e^2) with g = e2 r0,
// i.e. e2 / q to a relative 3 e^3 + O(eps)): the dependent chain is MUFU, 3 DFMA, the guard,
// instead of the division's MUFU + ~7 DFMA + a slow-path check. Backward stable like the exact
// form: every rounding is a relative perturbation of e2 or of t = d - x of a few ulps.
template <class Real> struct SplitSturm;
template <> struct SplitSturm<float> : SturmStep<float> {};
template <> struct SplitSturm<double> {
  static FS_HD double rcp_seed(double q) {
#if defined(__CUDA_ARCH__)
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(q));
    return r;
#else
    // the host's model of the seed: 1/q with its low 32 bits cleared (20 mantissa bits, as
    // MUFU.RCP64H computes the high word only), flushed to zero below DBL_MIN
    double r = 1.0 / q;
    uint64_t bits;
    std::memcpy(&bits, &r, sizeof bits);
    bits &= ~uint64_t(0xffffffffu);
    std::memcpy(&r, &bits, sizeof bits);
    return fabs(r) < DBL_MIN ? 0.0 : r;
#endif
  }
  static FS_HD double step(double q, double e2, double t) {
    const double r0 = rcp_seed(q);
    const double e = fma(-q, r0, 1.0);
    const double g = e2 * r0;
    const double f = fma(e, e, e);
    return fma(-g, f, t - g);
  }
  // 1 if q < 0, for q neither zero nor NaN: the sign bit of the high word (one LEA.HI with the
  // add, instead of a DSETP and a select)
  static FS_HD int negative(double q) {
#if defined(__CUDA_ARCH__)
    return static_cast<int>(static_cast<unsigned>(__double2hiint(q)) >> 31);
#else
    return q < 0;
#endif
  }
};

template <class Team, class Real>
FS_HD void split_eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  const Work<Real> wk = block_work(smem, static_cast<Real*>(nullptr), n);
  Real* const extra = smem + block_work_elems(n, true);
  Real* const a = wk.a;
  const int rs = wk.rs;
  const int T = split_cols(n), t = team.rank(), size = team.size(), col = t % T, half = t / T;

  // 1. load + mirror: member (col, half) reads column col, every other batch of 8 rows
  FS_PHASE(team, kPhaseLoad);
  const Real amax = team.max(load_lower_part(in, sr, sc, n, wk, col, T, half, 2));
  if (!(amax <= Num<Real>::huge()) || amax == 0) {  // uniform: amax is team-wide
    const Real fill = amax == 0 ? Real(0) : Num<Real>::nan_();
    for (int i = t; i < n; i += size) out[i] = fill;
    FS_PHASE(team, kPhaseEnd);
    return;
  }
  int ex = 0;
  Num<Real>::frexp_(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)

  // 2. exact scaling by 2^-ex: member (col, half) takes every other row of its column
  if (-ex >= Num<Real>::kMinExp && -ex <= Num<Real>::kMaxExp) {  // uniform
    const Real f = Num<Real>::ldexp_(Real(1), -ex);
    for (int c = col; c < n; c += T)
      for (int r = half; r < n; r += 2) a[r * rs + c] *= f;
  } else {
    for (int c = col; c < n; c += T)
      for (int r = half; r < n; r += 2) a[r * rs + c] = Num<Real>::ldexp_(a[r * rs + c], -ex);
  }

  // 3. tridiagonalization. Buffers: u (pending reflector j-1), w (its w), u2 (reflector j),
  // P and Q: the two halves' partial p = tau A u of reflector j (p = P + Q).
  Real *u = wk.v, *u2 = wk.v2;
  Real* const w = wk.w;
  Real* const P = wk.p2;
  Real* const Q = extra;
  for (int i = t; i < n; i += size) { u[i] = 0; P[i] = 0; Q[i] = 0; }
  Real tau = 0, local_pu = 0;
  for (int j = 0;; ++j) {
    FS_PHASE(team, kPhaseReflector);
    // (a) reflector j-1's w = p - (tau/2)(p.u) u (rows >= j), its update of column j (rows
    // >= j) and the norm of the updated column below row j + 1, in one pass. (p.u) comes from
    // the partial sums of the previous pass; its reduction is the barrier after that pass (and
    // after the scaling and the zeroing above, for j = 0). Every member computes w_j itself, by
    // the same expression as the member of row j.
    const Real hpu = Real(0.5) * tau * team.sum(local_pu);
    const Real uj = u[j];
    const Real wj = Num<Real>::fma_(-hpu, uj, P[j] + Q[j]);
    Real local_s = 0;
    for (int i = (j & ~3) + t; i < n; i += size) {
      const Real ui = u[i];
      const Real wi = i < j ? Real(0) : Num<Real>::fma_(-hpu, ui, P[i] + Q[i]);
      w[i] = wi;
      if (i >= j) {
        Real& x = a[i * rs + j];
        const Real y = Num<Real>::fma_(-wi, uj, Num<Real>::fma_(-ui, wj, x));  // update_trailing's expression
        x = y;
        if (i >= j + 2) local_s += y * y;
      }
    }
    if (j + 2 >= n) break;  // uniform: reflector j would be empty
    // (b) reflector j from column j (make_reflector's arithmetic)
    const Real sigma = team.sum(local_s);
    const int r1 = j + 1;
    const Real alpha = a[r1 * rs + j];
    Real beta = alpha, tau2 = 0, inv = 0;
    if (sigma > 0) {  // uniform
      beta = -Num<Real>::copysign_(Num<Real>::sqrt_(alpha * alpha + sigma), alpha);
      tau2 = (beta - alpha) / beta;
      inv = Real(1) / (alpha - beta);
    }
    if (t == 0) { wk.d[j] = a[j * rs + j]; wk.e[j] = beta; }
    for (int i = (j & ~3) + t; i < n; i += size)
      u2[i] = i < r1 ? Real(0) : (i == r1 ? Real(1) : a[i * rs + j] * inv);
    FS_SYNC(team);  // u2, w visible
    FS_PHASE(team, kPhaseUpdate);
    // (c) reflector j-1's rank-2 update of columns > j, fused with reflector j's partial p: member
    // (col, half) walks half of the rows of column j + 1 + col (a warp: 32 consecutive columns
    // of one half, conflict free); eig_core.h's update_rows, four rows per step.
    local_pu = 0;
    const int c = r1 + col;
    if (c < n) {
      const int r4 = j & ~3;
      const int mid = r4 + (((n - r4) / 2 + 3) & ~3);
      const int rb = half ? mid : r4, re = half ? n : (mid < n ? mid : n);
      const Real part = tau2 * update_rows<true>(wk, c, rb, re, u, w, u2);
      (half ? Q : P)[c] = part;
      local_pu = part * u2[c];
    }
    Real* tmp = u; u = u2; u2 = tmp;
    tau = tau2;
  }
  FS_SYNC(team);  // the last column's update and w visible
  FS_PHASE(team, kPhaseReflector);
  if (t == 0) {
    if (n >= 2) {
      wk.d[n - 2] = a[(n - 2) * rs + (n - 2)];
      wk.e[n - 2] = a[(n - 1) * rs + (n - 2)];
    }
    const Real ul = u[n - 1], wl = w[n - 1];
    wk.d[n - 1] = Num<Real>::fma_(-wl, ul, Num<Real>::fma_(-ul, wl, a[(n - 1) * rs + (n - 1)]));
  }
  FS_SYNC(team);  // d, e complete

  // 4. eigenvalues of T: (e^2, d) pairs in v..w, eigenvalues in v2, counts in extra
  Real* const te = wk.v;
  Real* const lam = wk.v2;
  Real* const gcount = extra;           // [1, G): counts at the grid's interior points
  Real* const scount = extra + 2 * T;   // [2T) per sweep parity: each member's count
  FS_PHASE(team, kPhaseIsolate);
  sturm_pairs(team, wk.d, wk.e, n, te);
  const Bracket<Real> br = gerschgorin(wk.d, wk.e, n);
  const Real lo = br.lo, hi = br.hi, pivmin = br.pivmin, tol = br.tol;
  const int cells = size;  // G = 2T grid cells: one count per member
  FS_SYNC(team);  // te complete
  if (t + 1 < cells) gcount[t + 1] = Real(sturm_count<Real, SplitSturm<Real>>(te, n, grid_point(lo, hi, t + 1, cells), pivmin));
  FS_SYNC(team);  // grid counts complete
  FS_PHASE(team, kPhaseRefine);
  // member (k, half) = (col, half): eigenvalue k, the interior point half of each trisection
  const int k = col;
  Real lb = 0, ub = 0;
  if (k < n) {
    int glo = 0, ghi = cells;
    while (ghi - glo > 1) {
      const int g = (glo + ghi) >> 1;
      if (gcount[g] > Real(k)) ghi = g; else glo = g;
    }
    lb = grid_point(lo, hi, glo, cells);
    ub = grid_point(lo, hi, ghi, cells);
  }
  // sweeps: the same number on every member (the barrier inside is uniform), enough for a grid
  // cell to shrink to tol by thirds; a converged eigenvalue skips its counts
  int sweeps = 0;
  for (Real width = (hi - lo) * (Real(1) / cells); width > tol && sweeps < 2 * (int(sizeof(Real)) * 8 + 16); ++sweeps)
    width *= Real(1) / 3;
  for (int s = 0; s < sweeps; ++s) {
    const Real third = (ub - lb) * (Real(1) / 3);
    const Real x1 = lb + third, x2 = ub - third;
    const bool active = k < n && ub - lb > tol && lb < x1 && x1 < x2 && x2 < ub;  // same on both halves
    Real* const cnt = scount + (s & 1) * (2 * T);
    if (active) cnt[t] = Real(sturm_count<Real, SplitSturm<Real>>(te, n, half ? x2 : x1, pivmin));
    FS_SYNC(team);  // both counts of every pair
    if (active) {
      const Real c1 = cnt[k], c2 = cnt[T + k];
      if (c1 > Real(k)) ub = x1;
      else if (c2 > Real(k)) { lb = x1; ub = x2; }
      else lb = x2;
    }
  }
  if (k < n && half == 0) lam[k] = lb + Real(0.5) * (ub - lb);
  FS_SYNC(team);  // eigenvalues complete
  FS_PHASE(team, kPhaseSort);
  // 5. ascending order (rank sort, as bisect_all), scaled back, straight to the output
  for (int kk = t; kk < n; kk += size) {
    const Real x = lam[kk];
    int pos = 0;
    for (int i = 0; i < n; ++i) pos += (lam[i] < x) || (lam[i] == x && i < kk);
    out[pos] = Num<Real>::ldexp_(x, ex);
  }
  FS_PHASE(team, kPhaseEnd);
}

}  // namespace fastspec
