// eig_packed.h — the "packed" algorithm (FS_ALGO 1) of the batched eigensolver: the lower
// triangle only, in shared memory. Same numerics as eig_core.h's block algorithm (LAPACK xSYTD2
// reflectors, Sturm bisection), half the memory and fewer instructions per element.
//
// Design envelope: eigenvalues only; float (n <= 256: 152 KiB at n = 256, where the block layout's
// 257 KiB does not fit an H100 block) and double (n <= 220 within 227 KiB). Team = one thread per
// column, round_up(n, 32) threads (the team must have >= n members: member c owns column c). n is
// a compile-time constant in the kernel (FS_N): panel strides and offsets fold.
// Shared memory (reals; fastspec/eig/variants.py's packed_smem_elems is the same formula):
//   [triangle: panels of 32 columns][u | u2 | w | p: round_up4(n) each]
//   Panel w (the columns of warp w) stores rows [32w, n) of each column at a column stride
//   S_w = stride0(n) - 32w (>= n - 32w, = 4 mod 8: 16-byte aligned, LDS.128/STS.128 conflict free
//   per quarter warp for float). Rows [32w, c) of column c are the mirror of the warp's 32 x 32
//   diagonal block, so a warp's lanes walk the same rows in step (broadcast u, w, u2; no
//   per-lane predicates). fp32 n = 128: 10752 + 512 reals = 45.3 KB with scratch: 5 blocks (20
//   warps) per H100 SM (80 registers: 5 x 128 x 80 <= 64K) vs 3 blocks / 12 warps for block.
//   After the tridiagonalization the dead triangle holds bisect_all's te and grid counts; d and e
//   go to w's and p's places, the eigenvalues to V + n4.
// Algorithm, per reflector j (pending reflector j-1: u, w, tau; new one: u2, tau2):
//   (a) reduction: h = tau/2 (p.u); each member stores its own w_c = p_c - h u_c;
//   (b) column j gets reflector j-1's update (member c row j + c, w recomputed with the same
//       fma), reduction of its squares, reflector j (beta, tau2, u2); FS_SYNC;
//   (c) column pass, member c over its own column, rows >= max(32w, j & ~3): rank-2 update of
//       reflector j-1 fused with the column part sum_{r >= 32w} A[r][c] u2[r]; FS_SYNC;
//   (d) row pass: sum_{r < 32w} A[c][r] u2[r], reading row c of the panels to the left (element
//       (c, r) in column r: consecutive c = consecutive addresses); p_c = tau2 (col + row), own.
//   4 barriers per reflector (2 reductions + 2 FS_SYNC) vs 6 for block. d[j] stays in place at
//   (j, j), e[j] = beta is written at (j + 1, j); the last reflector's update of the trailing
//   2 x 2 block is applied by the members gathering d and e. Then bisect_all (eig_core.h); eig_newton.h
//   runs all of the above (packed_eigvalsh_with) with an eigenvalue stage of its own.
//   Load: member c reads rows [32w, n) of its column, lower part only (a warp reads one row's 32
//   consecutive columns: coalesced), stores the lower part and the diagonal block's mirror; max
//   |a| and finiteness; exact 2^-e scaling pass. NaN/Inf -> all NaN; zero -> zeros (as block).
//
// Cost model, fp32 n = 128 (SASS from NVRTC 13.0 for sm_90, tests/test_eig_packed.py keeps the
// counts): 80 registers, no stack/local, no generic LD/ST.
//   * column pass: 42 instructions per 8 rows = 5.25 per element (24 FFMA, 2 LDS.128 + 2 STS.128
//     of the element, 6 LDS.128 broadcasts of u, w, u2, 4 address IMAD/LEA, 4 loop); shared
//     wavefronts 2.75 per element and warp (element 1 + 1, broadcasts 0.75), as block (6.75-6.9).
//   * row pass: 23 instructions per 8 elements = 2.9 per element (8 LDS at constant offsets,
//     8 FFMA, 2 LDS.128 of u2): 1.25 wavefronts per element.
//   * per matrix (sum over reflectors and warps, python model of the loop bounds): 18.5k
//     warp-rows of column pass (~110k instructions, ~51k wavefronts), 7.4k of row pass (~21k,
//     ~9k), per-reflector rest (2 reductions, column j, reflector, loop set-up; ~180
//     instructions and ~16 shared accesses per warp, an estimate from the listing) ~91k and ~8k;
//     tridiagonalization ~220k instructions, ~68k wavefronts (block: ~238k, ~72k+).
//     bisect_all unchanged: ~71-77k instructions, ~10k wavefronts; load + scale ~10k, ~3k.
//   => ~305k warp instructions (issue bound ~76k cycles per matrix per SM at 4/cycle) and ~81k
//      shared wavefronts (~81k cycles: the shared pipe, not issue, is the bound). 4096 matrices
//      = 31 per SM: PREDICTED ~2.5M cycles = 1.27-1.43 ms on an H100 SXM (1.75-1.98 GHz) IF the
//      latency is hidden. No GPU has run this. The block algorithm's model said 1.3-1.5 ms and
//      it MEASURED 3.69 ms on an H200 (2.2x its issue bound, 0.61 eligible warps per scheduler
//      at 12 warps/SM): latency bound. Here 20 warps per SM (5 per scheduler instead of 3) and
//      2 fewer barriers per reflector (each a drain of the block's 4 warps) should hide more of
//      the LDS latency (~30 cycles) chained into FFMAs, but each warp's dependent chain per
//      reflector is not shorter, and warp w's row pass is 32w rows while its column pass is
//      n - 32w: the load per warp is balanced, yet the warp with the longest column pass still
//      sets each reflector's critical path. A realistic guess from the block measurement's ratio
//      with 5/3 more warps: 2-2.5 ms; the 2 ms goal needs the latency hidden better than that.
//   * fp64 (off the target path): the = 4 mod 8 stride gives 2-way conflicts on the element's
//     LDS.128/STS.128 (double2 per lane); n = 256 fp64 does not fit (311 KB).
#pragma once
#include "eig_core.h"
#undef FS_SITE_BASE
#define FS_SITE_BASE 20000  // FS_SYNC sites of this file (eig_core.h)

namespace fastspec {

constexpr int kPackedMaxN = 256;
static_assert(kPackedMaxN <= kMaxThreads, "packed: one column per member, so n <= the largest team");

namespace packed_detail {

// Layout: columns grouped in panels of 32 (panel w = one warp's columns 32w..32w+31). Column c of
// panel w stores rows [32w, n): its lower part (rows >= c) and, above the diagonal, the mirror of
// the warp's own 32 x 32 diagonal block (so every lane of a warp walks the same rows). Within a
// panel the columns are S_w = stride0(n) - 32 w reals apart, S_w >= n - 32 w and S_w = 4 mod 8:
// 16-byte aligned, and the eight lanes of each quarter warp of an LDS.128/STS.128 hit eight
// different 16-byte bank groups (conflict free for float). Element (r, c), r >= 32 w, is at
// col_offset(n, c) + r.
FS_HD constexpr int stride0(int n) { return ((n + 3) & ~7) + 4; }
FS_HD constexpr int panel_stride(int n, int w) { return stride0(n) - 32 * w; }
FS_HD constexpr int64_t panel_base(int n, int w) {
  return 32 * static_cast<int64_t>(w) * stride0(n) - 512 * static_cast<int64_t>(w) * (w - 1);
}
FS_HD constexpr int64_t col_offset(int n, int c) {
  return panel_base(n, c >> 5) + static_cast<int64_t>(c & 31) * panel_stride(n, c >> 5) - 32 * (c >> 5);
}
// reals of the triangle: full panels, the last one holding only its n - 32 (P - 1) columns
FS_HD constexpr int64_t matrix_elems(int n) {
  return panel_base(n, (n + 31) / 32 - 1) +
         static_cast<int64_t>(n - 32 * ((n + 31) / 32 - 1)) * panel_stride(n, (n + 31) / 32 - 1);
}
// the bisection's v, w, v2, p2 (eig_core.h's Work) reuse the dead triangle at offset 0; the four
// vectors of the tridiagonalization (u, u2, w, p; later d and e in u2's and w's place) start at
// vec_base, after the triangle and after the bisection's vectors
FS_HD constexpr int64_t bisect_elems(int n) {
  return 3 * round_up4(n) + (round_up4(n) > kGrid ? round_up4(n) : kGrid);
}
FS_HD constexpr int64_t vec_base(int n) { return matrix_elems(n) > bisect_elems(n) ? matrix_elems(n) : bisect_elems(n); }

// The rank-2 update of one element, a -= u_r w_c + w_r u_c: the expression of eig_core.h's
// update_trailing and update_column, used for every element here.
template <class Real> FS_HD Real upd(Real a, Real ur, Real wr, Real uc, Real wc) {
  return Num<Real>::fma_(-wr, uc, Num<Real>::fma_(-ur, wc, a));
}

// Step 1: lower triangle of in -> the panels (lower part and the diagonal blocks' mirror).
// Member c reads rows [32 w, n) of column c (a warp reads one row's 32 consecutive columns:
// coalesced for row-major input; kBatch rows in flight). Returns the team max |a_ij|, +inf if any
// is NaN/Inf.
template <class Team, class Real>
FS_HD Real load(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* sm) {
  constexpr int kBatch = 8;
  Real local = 0;
  const int c = team.rank();
  if (c < n) {
    const int r0 = c & ~31, s = panel_stride(n, c >> 5);
    Real* col = sm + col_offset(n, c);
    const Real* src = in + static_cast<int64_t>(r0) * sr + static_cast<int64_t>(c) * sc;
    for (int rb = r0; rb < n; rb += kBatch, src += kBatch * sr) {
      Real x[kBatch];
FS_PRAGMA(unroll)
      for (int k = 0; k < kBatch; ++k) {
        const int r = rb + k;
        x[k] = (r >= c && r < n) ? src[k * sr] : Real(0);
      }
FS_PRAGMA(unroll)
      for (int k = 0; k < kBatch; ++k) {
        const int r = rb + k;
        if (r >= c && r < n) {
          col[r] = x[k];
          if (r > c && r < r0 + 32) col[(r - c) * s + c] = x[k];  // mirror: column r, row c
          const Real ax = Num<Real>::abs_(x[k]);
          local = (ax <= Num<Real>::huge()) ? (ax > local ? ax : local) : INFINITY;  // NaN fails <=
        }
      }
    }
  }
  return team.max(local);
}

// Step 2: every stored element (mirror included) times 2^-ex, exactly; member c its own column.
template <class Team, class Real>
FS_HD void scale(const Team& team, int n, int ex, Real* sm) {
  const int c = team.rank();
  if (c >= n) return;
  Real* col = sm + col_offset(n, c);
  const bool normal = -ex >= Num<Real>::kMinExp && -ex <= Num<Real>::kMaxExp;
  const Real f = normal ? Num<Real>::ldexp_(Real(1), -ex) : Real(0);
  int r = c & ~31;
  for (; r + 3 < n; r += 4) {
    Real a0, a1, a2, a3;
    load4(col + r, a0, a1, a2, a3);
    if (normal) {
      a0 *= f; a1 *= f; a2 *= f; a3 *= f;
    } else {
      a0 = Num<Real>::ldexp_(a0, -ex); a1 = Num<Real>::ldexp_(a1, -ex);
      a2 = Num<Real>::ldexp_(a2, -ex); a3 = Num<Real>::ldexp_(a3, -ex);
    }
    store4(col + r, a0, a1, a2, a3);
  }
  for (; r < n; ++r) col[r] = normal ? col[r] * f : Num<Real>::ldexp_(col[r], -ex);
}

}  // namespace packed_detail

FS_HD constexpr int packed_threads(int n) { return (n + 31) / 32 * 32 < kMaxThreads ? (n + 31) / 32 * 32 : kMaxThreads; }
FS_HD constexpr int64_t packed_smem_elems(int n) { return packed_detail::vec_base(n) + 4 * round_up4(n); }

// Step 3: Householder tridiagonalization of the panels; the pending reflector's update, the next
// reflector's p and its construction, 4 barriers per reflector (two of them reductions). Member c
// owns column c (the team has >= n members). Leaves d[j] in place at (j, j), e[j] at (j + 1, j)
// for j < n - 2; returns tau of the last reflector, whose update of the trailing 2 x 2 block is
// left to the caller (u, p returned through the pointers).
template <class Team, class Real>
FS_HD Real packed_tridiagonalize(const Team& team, int n, Real* sm, Real*& u, Real*& u2, Real* w, Real* p) {
  using namespace packed_detail;
  const int c = team.rank(), wc_ = c >> 5;
  Real tau = 0;
  for (int j = 0; j + 2 < n; ++j) {
    FS_PHASE(team, kPhaseReflector);
    // (a) reflector j-1's w = p - (tau/2)(p.u) u on rows >= j: h by one reduction, then every
    // member stores its own w and recomputes the w it needs for column j (same expression)
    const Real h = Real(0.5) * tau * team.sum((c >= j && c < n) ? p[c] * u[c] : Real(0));
    if (c >= (j & ~3) && c < n) w[c] = c < j ? Real(0) : Num<Real>::fma_(-h, u[c], p[c]);
    // (b) reflector j-1's update of column j (rows >= j, member c row j + c), then reflector j
    Real* colj = sm + col_offset(n, j);
    const Real uj = u[j], wj = Num<Real>::fma_(-h, u[j], p[j]);
    Real sq = 0;
    if (j + c < n) {
      const int i = j + c;
      const Real x = upd(colj[i], u[i], Num<Real>::fma_(-h, u[i], p[i]), uj, wj);
      colj[i] = x;
      if (i >= j + 2) sq = x * x;
    }
    const Real sigma = team.sum(sq);
    const Real alpha = colj[j + 1];
    Real beta = alpha, tau2 = 0, inv = 0;
    if (sigma > 0) {  // uniform: sigma is the same on every member
      beta = -Num<Real>::copysign_(Num<Real>::sqrt_(alpha * alpha + sigma), alpha);
      tau2 = (beta - alpha) / beta;
      inv = Real(1) / (alpha - beta);
    }
    {
      const int i = (j & ~3) + c;  // u2 on rows [j & ~3, n): zeros below j + 1 (load4 no-ops)
      if (i < n) u2[i] = i < j + 1 ? Real(0) : (i == j + 1 ? Real(1) : colj[i] * inv);
    }
    FS_SYNC(team);  // u2, w and column j visible; every member has read alpha
    FS_PHASE(team, kPhaseUpdate);
    // (c) one pass over member c's own column, rows >= max(32 w, j & ~3) (u = w = 0 below j,
    // u2 = 0 below j + 1): reflector j-1's update and the column part of p_c = tau2 (A u2)_c
    Real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    if (c > j && c < n) {
      Real* col = sm + col_offset(n, c);
      const Real uc = u[c], wc = w[c];
      int r = (j & ~3) > 32 * wc_ ? (j & ~3) : 32 * wc_;
FS_PRAGMA(unroll 2)
      for (; r + 3 < n; r += 4) {
        Real u0, u1, uu2, u3, w0, w1, w2, w3, x0, x1, x2, x3, a0, a1, a2, a3;
        load4(u + r, u0, u1, uu2, u3);
        load4(w + r, w0, w1, w2, w3);
        load4(u2 + r, x0, x1, x2, x3);
        load4(col + r, a0, a1, a2, a3);
        a0 = upd(a0, u0, w0, uc, wc);
        a1 = upd(a1, u1, w1, uc, wc);
        a2 = upd(a2, uu2, w2, uc, wc);
        a3 = upd(a3, u3, w3, uc, wc);
        s0 += a0 * x0;
        s1 += a1 * x1;
        s2 += a2 * x2;
        s3 += a3 * x3;
        store4(col + r, a0, a1, a2, a3);
      }
FS_PRAGMA(unroll 1)
      for (; r < n; ++r) {  // n % 4 rows
        const Real x = upd(col[r], u[r], w[r], uc, wc);
        s0 += x * u2[r];
        col[r] = x;
      }
    } else if (c == 0) {
      colj[j + 1] = beta;  // e[j], in place (member 0 never owns an active column)
    }
    FS_SYNC(team);  // the updated columns visible to the row pass
    FS_PHASE(team, kPhaseProduct);
    // (d) the row part: sum over rows r < 32 w of A[c][r] u2[r], A[c][r] stored in column r
    // (panel wp < w, lane r - 32 wp, row c): at fixed r the warp reads consecutive addresses
    if (c > j && c < n) {
      const int rs = (j + 1) & ~3;
FS_PRAGMA(unroll)
      for (int wp = 0; wp < (n + 31) / 32; ++wp) {
        if (wp >= (rs >> 5) && wp < wc_) {  // warp-uniform
          const int s = panel_stride(n, wp), l0 = rs > 32 * wp ? rs - 32 * wp : 0;
          const Real* q = sm + panel_base(n, wp) + (c - 32 * wp) + static_cast<int64_t>(l0) * s;
          const Real* x = u2 + 32 * wp;
FS_PRAGMA(unroll 2)
          for (int l = l0; l < 32; l += 4, q += 4 * s) {
            Real x0, x1, x2, x3;
            load4(x + l, x0, x1, x2, x3);
            s0 += q[0] * x0;
            s1 += q[s] * x1;
            s2 += q[2 * s] * x2;
            s3 += q[3 * s] * x3;
          }
        }
      }
      p[c] = tau2 * ((s0 + s1) + (s2 + s3));  // own entry: the next (a)'s reduction orders it
    }
    Real* t = u; u = u2; u2 = t;
    tau = tau2;
  }
  return tau;
}

// The eigenvalue stage of packed_eigvalsh_one: eig_core.h's bisect_all, then the scaling back.
// Stage::run(team, n, wk, ex, out): T in wk (d in w's place and e in p's, complete and visible to the
// team; e[n - 1] not written; the dead triangle free for the stage's vectors: wk.v, .w, .v2, .p2,
// bisect_all's layout) -> out[0..n-1] ascending, times 2^ex. eig_newton.h brings another.
struct PackedBisect {
  template <class Team, class Real>
  static FS_HD void run(const Team& team, int n, const Work<Real>& wk, int ex, Real* out) {
    bisect_all(team, n, wk);
    for (int i = team.rank(); i < n; i += team.size()) out[i] = Num<Real>::ldexp_(wk.d[i], ex);
  }
};

// One matrix: in [n, n] (strides sr, sc; lower triangle read) -> out[0..n-1] ascending; the
// eigenvalue stage is Stage's (PackedBisect here, eig_newton.h's NewtonStage for "newton").
template <class Stage, class Team, class Real>
FS_HD void packed_eigvalsh_with(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  using namespace packed_detail;
  const int c = team.rank();
  const int64_t n4 = round_up4(n);
  Real* u = smem + vec_base(n);
  Real* u2 = u + n4;
  Real* w = u2 + n4;
  Real* p = w + n4;
  FS_PHASE(team, kPhaseLoad);
  if (c < n) { u[c] = 0; p[c] = 0; }  // reflector -1: the identity (u = 0), p finite
  const Real amax = load(team, in, sr, sc, n, smem);  // its reduction orders the stores above
  if (!(amax <= Num<Real>::huge()) || amax == 0) {  // uniform branch: amax is team-wide
    const Real fill = amax == 0 ? Real(0) : Num<Real>::nan_();
    for (int i = c; i < n; i += team.size()) out[i] = fill;
    FS_PHASE(team, kPhaseEnd);
    return;  // nothing of this matrix is read after the reduction: no barrier before the next
  }
  int ex = 0;
  Num<Real>::frexp_(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)
  scale(team, n, ex, smem);  // mirrors written by others: after load's reduction
  // the scaled columns are read by others only after the first reflector's reduction
  const Real tau = packed_tridiagonalize(team, n, smem, u, u2, w, p);
  // the last reflector (n - 3) reaches the trailing 2 x 2 block (u = p = 0, tau = 0 for n < 3):
  // members n-2 and n-1 apply it to what they gather. d goes to w's place (dead: the tail
  // recomputes the w it needs), e to p's (member c < n - 2 overwrites its own p[c], which only
  // members >= n - 2 read; e[n-1] is not written), the eigenvalues to V + n4 (u or u2: written only
  // after this gather's barrier). Neither d nor the eigenvalues are written by the next matrix
  // before its first reflector's reduction: the rank sort (bisect_all) needs no barrier after it
  // but its own. te and the grid counts reuse the dead triangle.
  FS_PHASE(team, kPhaseReflector);
  const int jt = n >= 2 ? n - 2 : 0;
  const Real h = Real(0.5) * tau * team.sum((c >= jt && c < n) ? p[c] * u[c] : Real(0));
  Real* const vec = smem + vec_base(n);
  Work<Real> wk;
  wk.a = nullptr;
  wk.rs = wk.cs = 0;
  wk.d = vec + 2 * n4;
  wk.e = vec + 3 * n4;
  wk.v = smem;
  wk.w = smem + n4;
  wk.v2 = vec + n4;
  wk.p2 = smem + 3 * n4;
  if (c < n) {
    const Real* col = smem + col_offset(n, c);
    Real dd = col[c], ee = c + 1 < n ? col[c + 1] : Real(0);
    if (c >= jt) {
      const Real uc = u[c], wc = Num<Real>::fma_(-h, u[c], p[c]);
      dd = upd(dd, uc, wc, uc, wc);
      if (c + 1 < n) ee = upd(ee, u[c + 1], Num<Real>::fma_(-h, u[c + 1], p[c + 1]), uc, wc);
    }
    wk.d[c] = dd;
    if (c + 1 < n) wk.e[c] = ee;  // p[c], after this member's last read of it
  }
  FS_SYNC(team);  // d, e complete; the triangle no longer read (the stage's vectors overwrite it)
  Stage::run(team, n, wk, ex, out);
  FS_PHASE(team, kPhaseEnd);
  // no barrier: the next matrix writes u, p and the triangle before its first reduction, none of
  // which holds d (read here) or anything bisect_all reads after its last barrier
}

template <class Team, class Real>
FS_HD void packed_eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  packed_eigvalsh_with<PackedBisect>(team, in, sr, sc, n, out, smem);
}

}  // namespace fastspec
