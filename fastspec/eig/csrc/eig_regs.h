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
// partial products A x, the published column j+1), reused by eig_core.h's bisect_all afterwards.
// Launch bounds 256 threads x 2 blocks: <= 128 registers (NVRTC 13 for sm_90: 127, no stack, no
// local memory); 2 blocks = 16 warps per SM (the block algorithm: 3 blocks, 12 warps).
//
// Algorithm (per matrix; only the lower triangle of the input is read):
//   1. load straight into registers ((r, c) above the diagonal through its mirror (c, r); 64 loads
//      in flight per thread); max |a| and finiteness by team.max: NaN/Inf -> all-NaN output, zero
//      matrix -> zeros; exact scaling by 2^-e in registers (two products by normal powers of two,
//      so even 2^-127 and subnormal inputs scale exactly).
//   2. Householder tridiagonalization, xSYTD2 reflectors (as eig_core.h), rearranged so that the
//      only barriers inside the loop are the team's two reductions per reflector:
//        R  every member with work builds reflector j from x = column j (shared, zeros on rows <= j):
//           beta, tau, inv = 1/(alpha - beta) from alpha = x[j+1] and sigma (a team sum);
//        F  one register pass per column c > j over its chunks of 8 rows that reach past row j (the
//           work shrinks like (n-j)^2): the pending reflector j-1's update a -= u w_c + w u_c, fused
//           with s = sum a_new x (u, w, x: 128-bit broadcasts); the partial s of each half goes to
//           shared memory, and the owners of column j+1 publish it (up to date with reflector j-1);
//           each member adds y_c s_c, y = inv x, to a team sum: y.(A y);
//        W  with u = y - inv beta e_{j+1} (no u is ever materialized before F: the raw column
//           serves as the product vector, the one differing entry is a rank-one correction with the
//           published column): p = tau (A y - inv beta col), u.p = tau u.A.u from y.(A y), (A y)_{j+1}
//           and col_{j+1}; then w = p - (tau/2)(p.u) u, and column j+1 updated by reflector j becomes
//           the next x (and d[j+1]); its sum of squares -> the next sigma (a team sum).
//      2 barriers per reflector (the block algorithm: 5), both the reductions' own; FS_SYNC only
//      after the publication of column 0 and at the end. Rounding: the quadratic form u.A.u is
//      evaluated with every term O(||A||) (y and the scaled products), so its absolute error is
//      the O(eps ||A||) of the usual dot product p.u: backward stable like eig_core.h's.
//   3. eigenvalues of T by eig_core.h's bisect_all (Sturm bisection; 128 of the 256 threads own an
//      eigenvalue), scaled back by 2^e.
//
// Cost model, fp32 n = 128, 8 warps per matrix (SASS of NVRTC 13 for sm_90, counted with
// benchmarks/sass.py; tests/test_eig_regs.py keeps the counts). Per reflector, per warp:
//   * chunk of 8 rows x 32 columns: 6 LDS.128 broadcasts (u, w, x), 24 FFMA, branch + BSSY/BSYNC:
//     33-35 instructions = 4.1-4.4 per element, 0.75 shared wavefronts per element, no LDS/STS of
//     an element (the block algorithm: 6.75-6.9 instructions, 2.75 wavefronts). Chunk executions
//     over all reflectors (a warp runs a chunk if any of its 32 columns is > j and the chunk
//     reaches past row j): 3296 -> ~112k instructions, ~20k wavefronts per matrix.
//   * the rest of the reflector loop: the two reductions (shuffles, one STS, BAR, fold of 8 warp
//     totals: ~44 with the loop control, every warp), R (~45: sqrt and two IEEE divisions, fast
//     paths; only warps with a column >= j), F's set-up (~20), the publication of column j+1
//     (16 STS.128, one or two warps), W (~50, the half-0 warps with a column >= j)
//     -> ~56k + 29k + 13k + 8k + 16k = ~121k instructions per matrix.
//   * tridiagonalization ~233k instructions, ~30k shared wavefronts; bisect_all ~75k instructions
//     (as in eig_kernel.cu: 4 of the 8 warps own eigenvalues), ~10k wavefronts; load + max + scale
//     ~10k (the unrolled address arithmetic of 64 loads per thread).
//   => ~320k warp instructions and ~40k shared wavefronts per matrix (the block algorithm:
//      325-330k predicted, 394k measured, and 83k wavefronts): issue bound, ~80k cycles per matrix
//      per SM at 4 instructions per cycle. 4096 matrices = 31 per SM: 2.48M cycles, PREDICTED
//      ~1.25-1.42 ms on an H100 SXM (1.98-1.75 GHz) if the issue slots are kept busy; NOT the 1 ms
//      target (no GPU has run it). The block algorithm ran 2.2x its issue bound on an H200,
//      latency bound at 12 warps per SM; here 16 warps per SM (2 blocks x 8: the 4.3 KiB of shared
//      memory no longer limits, the 128 registers per thread do), the chunks carry 8 independent
//      update chains and 6 independent broadcasts per warp, and there are 2 barriers per
//      reflector instead of 5. What stays exposed is the serial chain per reflector (reduction ->
//      R's sqrt and divisions -> F -> reduction -> W -> reduction, ~1000 cycles of dependent
//      latency at early j): with two blocks per SM overlapping, PREDICTED ~1.3-1.8 ms, the upper end if the
//      chain is not hidden. Next levers: the two reductions on every warp and R (~85k, a
//      quarter of the total); bisection is a quarter too (eig_core.h).
#pragma once
#include "eig_core.h"
#undef FS_SITE_BASE
#define FS_SITE_BASE 30000  // FS_SYNC sites of this file (eig_core.h)

namespace fastspec {

constexpr int kRegsMaxN = 128;
constexpr int kRegsRows = 64;  // register rows per thread: the array a[] (indexed by constants only)
constexpr int kRegsChunk = 8;  // rows per skip decision (two 128-bit broadcasts of each vector)
constexpr int kRegsChunks = kRegsRows / kRegsChunk;

// Team: regs_cols(n) columns x 2 halves; thread t holds column t % regs_cols(n), rows
// [h * H, h * H + H) with h = t / regs_cols(n) and H = regs_half(n) = round_up(n, 16) / 2 (64 at
// n = 128; balanced halves below that, a multiple of 8 so chunks start 16-byte aligned).
FS_HD constexpr int regs_cols(int n) { return (n + 31) / 32 * 32; }
FS_HD constexpr int regs_threads(int n) { return 2 * regs_cols(n); }
FS_HD constexpr int regs_len(int n) { return (n + 15) / 16 * 16; }  // L: rows of both halves
FS_HD constexpr int regs_half(int n) { return regs_len(n) / 2; }     // H
// [d, e: round_up4(n) each] then one region used twice: during the tridiagonalization six vectors
// of L (u, w, x, p0, p1, col), during bisection eig_core.h's v, w, v2 (round_up4(n) each) and p2
// (max(round_up4(n), kGrid)).
FS_HD constexpr int64_t regs_region_elems(int n) {
  return 6 * regs_len(n) > 3 * round_up4(n) + (round_up4(n) > kGrid ? round_up4(n) : kGrid)
             ? 6 * regs_len(n)
             : 3 * round_up4(n) + (round_up4(n) > kGrid ? round_up4(n) : kGrid);
}
FS_HD constexpr int64_t regs_smem_elems(int n) { return 2 * round_up4(n) + regs_region_elems(n); }
static_assert(2 * kRegsMaxN / 32 * 32 <= kMaxThreads, "regs: the team of n = kRegsMaxN exceeds FS_MAX_THREADS");
static_assert(regs_half(kRegsMaxN) <= kRegsRows, "regs: a half holds at most kRegsRows rows");

// Four consecutive entries of a team-shared vector, p 16-byte aligned: one 128-bit store (fp32).
FS_HD void regs_store4(float* p, float x0, float x1, float x2, float x3) {
#if defined(__CUDA_ARCH__)
  float4 q;
  q.x = x0; q.y = x1; q.z = x2; q.w = x3;
  *reinterpret_cast<float4*>(p) = q;
#else
  p[0] = x0; p[1] = x1; p[2] = x2; p[3] = x3;
#endif
}
FS_HD void regs_store4(double* p, double x0, double x1, double x2, double x3) {
#if defined(__CUDA_ARCH__)
  double2 q0, q1;
  q0.x = x0; q0.y = x1; q1.x = x2; q1.y = x3;
  reinterpret_cast<double2*>(p)[0] = q0;
  reinterpret_cast<double2*>(p)[1] = q1;
#else
  p[0] = x0; p[1] = x1; p[2] = x2; p[3] = x3;
#endif
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

  // ---- 3. tridiagonalization. Per reflector j: R (everyone builds tau, beta from x = X, sigma),
  // F (fused register pass: pending reflector j-1's rank-2 update + partial A x), sum of
  // y.(A y) -> barrier, W (p, u, w of reflector j, column j+1 updated by it -> X), sum of
  // sigma -> barrier. Two barriers per reflector, both in the team's reductions.
  // Column 0, published by its owners, is the first X.
  if (c == 0) {
FS_PRAGMA(unroll)
    for (int k = 0; k < kRegsChunks; ++k)
      if (k * kRegsChunk < H) {
        regs_store4(C + row0 + k * kRegsChunk, a[8 * k], a[8 * k + 1], a[8 * k + 2], a[8 * k + 3]);
        regs_store4(C + row0 + k * kRegsChunk + 4, a[8 * k + 4], a[8 * k + 5], a[8 * k + 6], a[8 * k + 7]);
      }
  }
  FS_SYNC(team);
  Real sig = 0;  // this member's part of sigma = sum x_i^2, i >= j + 2, of the next reflector
  if (h == 0 && c < L) {
    const Real x = C[c];
    U[c] = 0;  // reflector -1: the identity (u = w = 0, its update subtracts exact zeros)
    W[c] = 0;
    if (c == 0) d[0] = x;
    X[c] = c == 0 ? Real(0) : x;
    sig = c >= 2 ? x * x : Real(0);
  }
  for (int j = 0; j + 1 < n; ++j) {  // reflector n-2 is the identity (sigma = 0): it yields e[n-2], d[n-1]
    const int j1 = j + 1;
    // R: reflector j from X (xSYTD2): H = I - tau u u^T, u = [1, x[1:] * inv], inv = 1/(alpha - beta)
    const Real sigma = team.sum(sig);
    Real beta = 0, tau = 0, inv = 0;
    if (c >= j && c < n) {  // only members with work in F or W (whole warps past the front skip it)
      const Real alpha = X[j1];
      beta = alpha;
      if (sigma > 0) {  // uniform
        beta = -N::copysign_(N::sqrt_(alpha * alpha + sigma), alpha);
        tau = (beta - alpha) / beta;
        inv = Real(1) / (alpha - beta);
      }
      if (c == j1 && h == 0) e[j] = beta;
    }
    // F: columns c > j, rows in chunks reaching past j (u = w = 0 and x = 0 below: exact no-ops)
    Real q = 0;
    if (c > j && c < n) {
      const Real uc = U[c], wc = W[c];
      Real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
FS_PRAGMA(unroll)
      for (int k = 0; k < kRegsChunks; ++k) {
        if (k * kRegsChunk < H && row0 + k * kRegsChunk + kRegsChunk - 1 > j) {
          const int r = row0 + k * kRegsChunk;
          Real u[8], w[8], x[8];
          load4(U + r, u[0], u[1], u[2], u[3]);
          load4(U + r + 4, u[4], u[5], u[6], u[7]);
          load4(W + r, w[0], w[1], w[2], w[3]);
          load4(W + r + 4, w[4], w[5], w[6], w[7]);
          load4(X + r, x[0], x[1], x[2], x[3]);
          load4(X + r + 4, x[4], x[5], x[6], x[7]);
FS_PRAGMA(unroll)
          for (int m = 0; m < 8; ++m) {
            Real& y = a[k * kRegsChunk + m];
            y = N::fma_(-w[m], uc, N::fma_(-u[m], wc, y));
            if (m % 4 == 0) s0 = N::fma_(y, x[m], s0);
            else if (m % 4 == 1) s1 = N::fma_(y, x[m], s1);
            else if (m % 4 == 2) s2 = N::fma_(y, x[m], s2);
            else s3 = N::fma_(y, x[m], s3);
          }
        }
      }
      const Real s = (s0 + s1) + (s2 + s3);
      P[h * L + c] = s;
      q = (inv * X[c]) * (inv * s);  // y_c (A y)_c, y = inv * x: O(|A|), no underflow of x^2
    }
    if (c == j1) {  // column j + 1, now up to date with reflector j-1: publish (rows > j suffice)
FS_PRAGMA(unroll)
      for (int k = 0; k < kRegsChunks; ++k)
        if (k * kRegsChunk < H && row0 + k * kRegsChunk + kRegsChunk - 1 > j) {
          regs_store4(C + row0 + k * kRegsChunk, a[8 * k], a[8 * k + 1], a[8 * k + 2], a[8 * k + 3]);
          regs_store4(C + row0 + k * kRegsChunk + 4, a[8 * k + 4], a[8 * k + 5], a[8 * k + 6], a[8 * k + 7]);
        }
    }
    const Real yAy = team.sum(q);
    // W: with u = y - ub e_{j+1} (ub = inv * beta; u_{j+1} = inv (alpha - beta) = 1) and T = A y:
    // p = tau A u = tau (T - ub col), u.A.u = y.T - 2 ub T_{j+1} + ub^2 col_{j+1}.
    sig = 0;
    if (h == 0 && c >= j && c < n) {  // c < j (and n <= c < L): u = w = x = 0 already
      const Real ub = inv * beta;
      const Real T1 = inv * (P[j1] + P[L + j1]), C1 = C[j1];
      const Real uAu = N::fma_(ub * ub, C1, N::fma_(Real(-2) * ub, T1, yAy));
      const Real half_tau_pu = Real(0.5) * tau * (tau * uAu);
      const Real w1 = tau * N::fma_(-ub, C1, T1) - half_tau_pu;  // w_{j+1} (every member alike)
      Real uc = 0, wc = 0, xn = 0;
      if (c > j) {
        const Real Tc = inv * (P[c] + P[L + c]), Cc = C[c];
        uc = c == j1 ? Real(1) : inv * X[c];
        wc = tau * N::fma_(-ub, Cc, Tc) - half_tau_pu * uc;
        xn = N::fma_(-wc, Real(1), N::fma_(-uc, w1, Cc));  // F's update of (c, j+1), u_{j+1} = 1
      }
      U[c] = uc;
      W[c] = wc;
      X[c] = c > j1 ? xn : Real(0);
      if (c == j1) d[j1] = xn;
      sig = c >= j + 3 ? xn * xn : Real(0);
    }
  }
  FS_SYNC(team);  // d[n-1] (last W) and e[n-2] complete; the region is bisect_all's from here

  // ---- 4-5. eigenvalues of T (eig_core.h), scaled back
  Work<Real> wk;
  wk.a = nullptr;
  wk.rs = 0;
  wk.cs = 0;
  wk.d = d;
  wk.e = e;
  wk.v = region;
  wk.w = region + n4;
  wk.v2 = region + 2 * n4;
  wk.p2 = region + 3 * n4;
  bisect_all(team, n, wk);
  for (int i = t; i < n; i += team.size()) out[i] = N::ldexp_(d[i], ex);
}

}  // namespace fastspec
