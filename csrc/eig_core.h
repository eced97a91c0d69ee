// eig_core.h — per-matrix numerics of fastspec's batched symmetric eigensolver, compiled for
// both host and device: the CUDA kernel (eig_kernel.cu, compiled at run time by NVRTC) and the
// host twin (eig_host.cpp, built by setup.py) run exactly this code, so CPU-only CI checks the
// algorithm itself.
//
// Design envelope: eigenvalues only, real symmetric, n up to a few hundred (tuned for n = 128;
// the limits are in fastspec/eig/limits.py), float or double. One "team" per matrix: a CUDA
// thread block on the device, a single thread on the host.
// Loops are written `for (i = team.rank(); i < n; i += team.size())` with explicit team.sync()
// barriers, so the same source is a parallel block algorithm on the GPU and a serial one on the
// host. Team reductions return bitwise-identical values on every member, which keeps every
// data-dependent branch uniform across the block (no divergent barriers, no hangs).
//
// Algorithm (per matrix, only the lower triangle of the input is read):
//   1. load + mirror into a full n x n work matrix; max |a_ij| and a finiteness check.
//      non-finite input -> all n outputs NaN; zero matrix -> all zeros.
//   2. scale by 2^-e (exact) so max |a_ij| is in [0.5, 1): no overflow/underflow for inputs
//      anywhere in the floating range (1e+-30 in fp32 included); results are scaled back by 2^e.
//   3. Householder tridiagonalization (unblocked, LAPACK xSYTD2-style reflectors, full-storage
//      symmetric rank-2 updates): A = Q T Q^T.  ~2 n^3 flops (4.2 MFLOP at n = 128). The rank-2
//      update of reflector k and the product p = tau A u of reflector k+1 are ONE pass over the
//      trailing matrix (each updated element is multiplied by u_{k+1} while still in registers):
//      ~2.75 shared-memory accesses per element and reflector instead of ~3.75 for two passes.
//   4. eigenvalues of T by Sturm-count bisection (xSTEBZ-style pivmin guard against zero pivots):
//      one team-wide pass counts at 128 grid points of the Gerschgorin interval, which brackets
//      every eigenvalue in 1/128 of it (7 halvings for the price of one count per member); then
//      one eigenvalue per member is bisected to an absolute width of eps * ||T||. fp32: ~20 Sturm
//      sweeps per eigenvalue instead of ~26. Iteration count hard-capped: it always terminates.
//      (Multisection, several counts per sweep, was tried: with 12 warps per SM the sweeps are
//      issue bound, and 1.5 counts per halving issue more instructions than bisection's 1.)
//   5. ascending order enforced by a parallel rank sort (rounding may swap neighbours), scale back.
// Error: backward stable, |lambda - lambda_exact| <= c(n) * eps * ||A||_2, like LAPACK xSYEVD.
#pragma once

// The limits and layout numbers are written once, in fastspec/eig/limits.py; NVRTC
// (fastspec/eig/nvrtc.py) and setup.py pass them in as macros, so no copy here can drift.
#if !defined(FS_MAX_N) || !defined(FS_MAX_THREADS) || !defined(FS_GRID) || !defined(FS_SCRATCH)
#error "compile with the macros of fastspec/eig/limits.py: FS_MAX_N, FS_MAX_THREADS, FS_GRID, FS_SCRATCH"
#endif

#if defined(__CUDACC_RTC__)
// NVRTC ships no C or C++ standard headers: the constants and the one type used below, spelled
// exactly (hexadecimal literals, the values of <cfloat>; tests/test_eig_nvrtc.py checks them
// against numpy.finfo). The math functions (sqrtf, fmaf, ldexpf, ...) are NVRTC built-ins.
typedef long long int64_t;
#define FLT_EPSILON 0x1p-23f
#define FLT_MIN 0x1p-126f
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN_EXP (-125)
#define FLT_MAX_EXP 128
#define DBL_EPSILON 0x1p-52
#define DBL_MIN 0x1p-1022
#define DBL_MAX 0x1.fffffffffffffp+1023
#define DBL_MIN_EXP (-1021)
#define DBL_MAX_EXP 1024
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#else
#include <cfloat>
#include <cmath>
#include <cstdint>
#endif

// A team barrier, tagged with its site: FS_SITE_BASE (10000 x a number of its own, defined by each
// header after its includes) + the source line. The team emulation (eig_host.cpp) records the site
// of every barrier it passes and can leave one out, which is how the tests show that each barrier
// of each algorithm is needed and that a missing one would be caught. Devices ignore it.
#define FS_SYNC(team) (team).sync(FS_SITE_BASE + __LINE__)
#undef FS_SITE_BASE
#define FS_SITE_BASE 10000

// Phase marks, for the profiling build and the team emulation. FS_PHASE(team, p): from here on, this
// member's time counts toward phase p. In the profiling build of the kernel (eig_kernel.cu, FS_PROFILE
// 1) member 0 of each block stamps clock64() with the phase id into a global buffer at every mark,
// and every barrier (FS_SYNC or a reduction's) counts as kPhaseBarrier, then resumes the phase it
// interrupted; the normal build compiles the marks to nothing. The team emulation (eig_host.cpp)
// records the same sequence of ids on rank 0, so CPU CI checks where the marks are. The ids are
// fastspec/eig/profile.py's PHASES (tests check them equal); what each phase holds:
//   load       read the lower triangle, max |a|, finiteness, the exact 2^-e scaling
//   reflector  per reflector: the reductions' arithmetic, the column the reflector is built from,
//              beta, tau, u and w (everything of a reflector but the trailing pass and the barriers)
//   update     the trailing pass: the rank-2 update, fused with the next reflector's product A u
//   product    a product pass of its own (eig_packed.h's row pass, eig_regs.h's column publication)
//   barrier    waiting at a barrier (member 0's view: the wait for the slowest warp)
//   isolate    the eigenvalue stage's set-up: T's (e^2, d) pairs, the Gerschgorin interval, the
//              team-wide count at the grid points
//   refine     per eigenvalue: from its grid cell to its final width (bisection or faster)
//   sort       ascending order, scaling back, the output's store
//   end        after the last store (the mark that closes the previous phase)
#define FS_PHASE(team, p) (team).phase(::fastspec::p)

#if defined(__CUDACC__)
#define FS_HD __host__ __device__ __forceinline__
#define FS_PRAGMA(x) _Pragma(#x)  // loop pragmas for nvcc only (the host compiler's vectorizer decides)
#else
#define FS_HD inline
#define FS_PRAGMA(x)
#endif

namespace fastspec {

enum Phase : int {
  kPhaseLoad = 0, kPhaseReflector = 1, kPhaseUpdate = 2, kPhaseProduct = 3, kPhaseBarrier = 4,
  kPhaseIsolate = 5, kPhaseRefine = 6, kPhaseSort = 7, kPhaseEnd = 8, kPhaseCount = 9
};

// Real-type traits: machine constants and overloads that resolve the same on host and device.
template <class Real> struct Num;
template <> struct Num<float> {
  static FS_HD float eps() { return FLT_EPSILON * 0.5f; }  // unit round-off
  static FS_HD float tiny() { return FLT_MIN; }
  static FS_HD float huge() { return FLT_MAX; }
  static constexpr int kMinExp = FLT_MIN_EXP - 1, kMaxExp = FLT_MAX_EXP - 1;  // normal powers of two
  static FS_HD float sqrt_(float x) { return sqrtf(x); }
  static FS_HD float fma_(float x, float y, float z) { return fmaf(x, y, z); }
  static FS_HD float abs_(float x) { return fabsf(x); }
  static FS_HD float copysign_(float m, float s) { return copysignf(m, s); }
  static FS_HD float ldexp_(float x, int e) { return ldexpf(x, e); }
  static FS_HD float frexp_(float x, int* e) { return frexpf(x, e); }
  static FS_HD float nan_() { return NAN; }
  // The Sturm recurrence's division. Device: one MUFU reciprocal (rcp.approx.ftz, <= 1 ulp) and a
  // multiply, no IEEE slow path and no denormal fix-up (the pivmin guard keeps |den| >= FLT_MIN;
  // a quotient flushed to 0 for |den| > 2^126 is what the exact one rounds to at this scale).
  // Host: reciprocal then multiply, two roundings as well, so CPU CI sees an inexact division in
  // the recurrence too. Either is backward stable for the count (a few ulps per step).
  static FS_HD float sturm_div(float num, float den) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(den));
    return num * r;
#else
    return num * (1.0f / den);
#endif
  }
  // 1 if q < 0, for q neither zero nor NaN (the Sturm pivots): the sign bit, one LEA.HI with the add
  static FS_HD int negative(float q) {
#if defined(__CUDA_ARCH__)
    return static_cast<int>(__float_as_uint(q) >> 31);
#else
    return q < 0;
#endif
  }
};
template <> struct Num<double> {
  static FS_HD double eps() { return DBL_EPSILON * 0.5; }
  static FS_HD double tiny() { return DBL_MIN; }
  static FS_HD double huge() { return DBL_MAX; }
  static constexpr int kMinExp = DBL_MIN_EXP - 1, kMaxExp = DBL_MAX_EXP - 1;
  static FS_HD double sqrt_(double x) { return sqrt(x); }
  static FS_HD double fma_(double x, double y, double z) { return fma(x, y, z); }
  static FS_HD double abs_(double x) { return fabs(x); }
  static FS_HD double copysign_(double m, double s) { return copysign(m, s); }
  static FS_HD double ldexp_(double x, int e) { return ldexp(x, e); }
  static FS_HD double frexp_(double x, int* e) { return frexp(x, e); }
  static FS_HD double nan_() { return NAN; }
  static FS_HD double sturm_div(double num, double den) { return num / den; }  // fp64: off the fast path
  static FS_HD int negative(double q) { return q < 0; }
};

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles device code only
// The serial team used by the host twin.
struct HostTeam {
  int rank() const { return 0; }
  int size() const { return 1; }
  void sync(int = 0) const {}
  void phase(int) const {}
  template <class Real> Real sum(Real x) const { return x; }
  template <class Real> Real max(Real x) const { return x; }
};
#endif

// Four consecutive entries of a team-shared vector; p must be 16-byte aligned on the device, where
// it is one 128-bit broadcast load per warp (two for double) instead of four: these broadcasts
// are a third of the shared-memory traffic of the tridiagonalization.
FS_HD void load4(const float* p, float& x0, float& x1, float& x2, float& x3) {
#if defined(__CUDA_ARCH__)
  const float4 q = *reinterpret_cast<const float4*>(p);
  x0 = q.x; x1 = q.y; x2 = q.z; x3 = q.w;
#else
  x0 = p[0]; x1 = p[1]; x2 = p[2]; x3 = p[3];
#endif
}
FS_HD void load4(const double* p, double& x0, double& x1, double& x2, double& x3) {
#if defined(__CUDA_ARCH__)
  const double2 q0 = reinterpret_cast<const double2*>(p)[0], q1 = reinterpret_cast<const double2*>(p)[1];
  x0 = q0.x; x1 = q0.y; x2 = q1.x; x3 = q1.y;
#else
  x0 = p[0]; x1 = p[1]; x2 = p[2]; x3 = p[3];
#endif
}

// Four consecutive reals to a 16-byte aligned team-shared address: one STS.128 (two for double).
FS_HD void store4(float* p, float x0, float x1, float x2, float x3) {
#if defined(__CUDA_ARCH__)
  float4 q;
  q.x = x0; q.y = x1; q.z = x2; q.w = x3;
  *reinterpret_cast<float4*>(p) = q;
#else
  p[0] = x0; p[1] = x1; p[2] = x2; p[3] = x3;
#endif
}
FS_HD void store4(double* p, double x0, double x1, double x2, double x3) {
#if defined(__CUDA_ARCH__)
  double2 q0, q1;
  q0.x = x0; q0.y = x1; q1.x = x2; q1.y = x3;
  reinterpret_cast<double2*>(p)[0] = q0;
  reinterpret_cast<double2*>(p)[1] = q1;
#else
  p[0] = x0; p[1] = x1; p[2] = x2; p[3] = x3;
#endif
}

// Work arrays of one matrix: a (n rows of stride rs) plus six vectors of n, each 16-byte aligned.
template <class Real> struct Work {
  Real* a;   // full symmetric copy, element (r, c) at a[r * rs + c * cs]
  int rs, cs;  // device: row-major, rs = n + 1 (padded: a column's n entries fall in n different
               // banks, so column reads and the mirrored stores of the load are conflict free;
               // a block's threads walk consecutive columns of a row). host: column-major
               // (rs = 1, cs = n): the inner loops over r are contiguous and vectorize.
  Real* d;   // diagonal of T; at the end the sorted eigenvalues
  Real* e;   // off-diagonal of T (e[i] couples i, i+1)
  Real* v;   // Householder vector u of the pending reflector; then, with w, the (e^2, d) pairs
  Real* w;   // its w = p - (tau/2)(p.u) u; must directly follow v
  Real* v2;  // the next reflector's u; later the eigenvalues
  Real* p2;  // the next reflector's p = tau A u; later the grid counts of the bisection. Last,
             // and max(n, kGrid) long (work_vector_elems)
};

constexpr int kGrid = FS_GRID;  // grid cells of the bisection's first, team-wide count pass
constexpr int kMaxN = FS_MAX_N;  // largest n of the native solvers (the kernel and the host twin)
constexpr int kMaxThreads = FS_MAX_THREADS;  // largest team: the CUDA block, the host team emulation
constexpr int kScratch = FS_SCRATCH;  // reals of reduction scratch after a block's work arrays
static_assert(kGrid > 0 && kMaxN > 0 && kMaxThreads % 32 == 0 && kMaxThreads <= 1024, "limits.py: bad values");
static_assert(kScratch >= 2 * (kMaxThreads / 32), "limits.py: SCRATCH holds two halves of one real per warp");

#if !defined(__CUDACC_RTC__)
// Reals of the six vectors of Work, d..p2, for the host twin (each n long, p2 >= kGrid).
inline constexpr int64_t work_vector_elems(int64_t n) { return 5 * n + (n > kGrid ? n : kGrid); }
#endif

FS_HD constexpr int64_t round_up4(int64_t x) { return (x + 3) & ~int64_t(3); }

// The CUDA kernel's layout of one block's work arrays (eig_kernel.cu; the team emulation in
// eig_host.cpp runs on the same): [the matrix, n rows of stride n + 1, when it lives here]
// [d, e, v, w, v2: round_up4(n) each] [p2: max(round_up4(n), kGrid)]. Every vector starts
// 16-byte aligned (load4, load2), w directly follows v, and the padded rows put a column's
// entries in distinct shared-memory banks. A matrix elsewhere (the global workspace) is dense.
FS_HD constexpr int64_t block_work_elems(int n, bool matrix_here) {
  return (matrix_here ? round_up4(static_cast<int64_t>(n) * (n + 1)) : 0) + 5 * round_up4(n) +
         (round_up4(n) > kGrid ? round_up4(n) : kGrid);
}
template <class Real> FS_HD Work<Real> block_work(Real* base, Real* matrix_elsewhere, int n) {
  const int64_t n4 = round_up4(n);
  Work<Real> wk;
  wk.rs = matrix_elsewhere ? n : n + 1;
  wk.cs = 1;
  wk.a = matrix_elsewhere ? matrix_elsewhere : base;
  wk.d = base + (matrix_elsewhere ? 0 : round_up4(static_cast<int64_t>(n) * (n + 1)));
  wk.e = wk.d + n4;
  wk.v = wk.e + n4;
  wk.w = wk.v + n4;
  wk.v2 = wk.w + n4;
  wk.p2 = wk.v2 + n4;
  return wk;
}
constexpr int kPaddedRows128 = 128 + 1;  // block_work's row stride at the aimed-for n = 128

// Step 1: mirror the lower triangle of in (strides sr, sc in elements) into wk.a.
// Returns max |a_ij| over the lower triangle, +inf if any entry there is NaN/Inf.
// Rows are walked in step by the whole team (member = column), so a warp reads one row's
// consecutive columns (coalesced for row-major input); kBatch rows are loaded before the first
// store, so that many global loads are in flight per thread. No division per element.
// load_lower_part is one member's share, without the team's max: columns c0, c0 + cstep, ...,
// and of each the batches of rows part, part + parts, ... (eig_split.h: two members a column).
template <class Real>
FS_HD Real load_lower_part(const Real* in, int64_t sr, int64_t sc, int n, Work<Real> wk, int c0, int cstep,
                           int part = 0, int parts = 1) {
  constexpr int kBatch = 8;
  Real local = 0;
  for (int c = c0; c < n; c += cstep) {
    // rows below c are the strict upper triangle (never read: torch UPLO='L' semantics); start
    // at a multiple of 32 so a warp's 32 columns stay on the same row
    const int rstart = (c & ~31) + kBatch * part;
    const Real* src = in + static_cast<int64_t>(rstart) * sr + static_cast<int64_t>(c) * sc;
    for (int r0 = rstart; r0 < n; r0 += kBatch * parts, src += kBatch * parts * sr) {
      Real x[kBatch];
FS_PRAGMA(unroll)
      for (int j = 0; j < kBatch; ++j) {
        const int r = r0 + j;
        x[j] = (r >= c && r < n) ? src[j * sr] : Real(0);
      }
FS_PRAGMA(unroll)
      for (int j = 0; j < kBatch; ++j) {
        const int r = r0 + j;
        if (r >= c && r < n) {
          wk.a[r * wk.rs + c * wk.cs] = x[j];
          wk.a[c * wk.rs + r * wk.cs] = x[j];
          const Real ax = Num<Real>::abs_(x[j]);
          local = (ax <= Num<Real>::huge()) ? (ax > local ? ax : local) : INFINITY;  // NaN fails <=
        }
      }
    }
  }
  return local;
}
template <class Team, class Real>
FS_HD Real load_lower(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Work<Real> wk) {
  return team.max(load_lower_part(in, sr, sc, n, wk, team.rank(), team.size()));
}

// Step 2: a <- a * 2^-ex for the n x n matrix, exactly (a product by a normal power of two is
// ldexp, rounding included; ldexp itself only for scales outside the normal range).
template <class Team, class Real>
FS_HD void scale_matrix(const Team& team, int n, int ex, Work<Real> wk) {
  if (-ex >= Num<Real>::kMinExp && -ex <= Num<Real>::kMaxExp) {  // uniform
    const Real f = Num<Real>::ldexp_(Real(1), -ex);
    for (int c = team.rank(); c < n; c += team.size())
      for (int r = 0; r < n; ++r) wk.a[r * wk.rs + c * wk.cs] *= f;
  } else {
    for (int c = team.rank(); c < n; c += team.size())
      for (int r = 0; r < n; ++r) wk.a[r * wk.rs + c * wk.cs] = Num<Real>::ldexp_(wk.a[r * wk.rs + c * wk.cs], -ex);
  }
}

// Reflector j from column j (its pending update already applied to rows >= j of that column):
// x = a[j+1:, j]; H = I - tau u u^T with u = [1, x[1:] / (alpha - beta)] maps x to beta e1.
// Writes d[j], e[j] and u into `u` on rows [j & ~3, n) (zeros below j + 1: exact no-ops in the
// aligned load4 loops). Returns tau (0: x is already a multiple of e1, u = e1, nothing to do).
// Precondition: column j's rows >= j are visible to the whole team. Ends without a barrier.
template <class Team, class Real>
FS_HD Real make_reflector(const Team& team, int j, int n, Work<Real> wk, Real* u) {
  const Real* a = wk.a;
  const int rs = wk.rs, cs = wk.cs, r0 = j + 1;
  Real local = 0;
  for (int i = r0 + 1 + team.rank(); i < n; i += team.size()) local += a[i * rs + j * cs] * a[i * rs + j * cs];
  const Real sigma = team.sum(local);
  const Real alpha = a[r0 * rs + j * cs];
  Real beta = alpha, tau = 0, inv = 0;
  if (sigma > 0) {  // uniform: sigma is the same on every member
    beta = -Num<Real>::copysign_(Num<Real>::sqrt_(alpha * alpha + sigma), alpha);
    tau = (beta - alpha) / beta;
    inv = Real(1) / (alpha - beta);
  }
  if (team.rank() == 0) { wk.d[j] = a[j * rs + j * cs]; wk.e[j] = beta; }
  for (int i = (j & ~3) + team.rank(); i < n; i += team.size())
    u[i] = i < r0 ? Real(0) : (i == r0 ? Real(1) : a[i * rs + j * cs] * inv);
  return tau;
}

// The pending reflector's update of column j alone, rows >= j: a[i][j] -= u_i w_j + w_i u_j.
// Column j is the next reflector's input, so it goes first, parallel over rows.
template <class Team, class Real>
FS_HD void update_column(const Team& team, int j, int n, Work<Real> wk, const Real* u, const Real* w) {
  const Real uj = u[j], wj = w[j];
  for (int i = j + team.rank(); i < n; i += team.size()) {
    Real& x = wk.a[i * wk.rs + j * wk.cs];
    x = Num<Real>::fma_(-w[i], uj, Num<Real>::fma_(-u[i], wj, x));  // update_trailing's expression
  }
}

// Rows [rb, re) of column c (rb a multiple of 4; u = w = 0 on rows below the pending reflector's
// first row): a[r][c] -= u_r w_c + w_r u_c and, with WITH_P, returns sum_r a_new[r][c] u2[r] (u2 = 0
// on rows below its first row; 0 without WITH_P). Four rows per step, loads first, then the
// arithmetic, then the stores (the stores may alias the vectors as far as the compiler knows: loads
// after them would serialize). Four interleaved partial sums: four independent FMA chains, and a
// rounding error bound growing with n/4 terms instead of n. kRowStride > 0: the row stride as a
// compile-time constant (the kernel's padded n = 128 layout), so the four rows' addresses are
// immediate offsets of one pointer.
template <bool WITH_P, int kRowStride = 0, class Real>
FS_HD Real update_rows(Work<Real> wk, int c, int rb, int re, const Real* u, const Real* w, const Real* u2) {
  Real* a = wk.a;
  const int rs = kRowStride > 0 ? kRowStride : wk.rs, cs = wk.cs;
  const Real uc = u[c], wc = w[c];
  Real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  Real* pa = a + rb * rs + c * cs;  // walks the column: one pointer step per four rows
  int r = rb;
FS_PRAGMA(unroll 2)
  for (; r + 3 < re; r += 4, pa += 4 * rs) {
    Real u0, u1, uu2, u3, w0, w1, w2, w3;
    load4(u + r, u0, u1, uu2, u3);
    load4(w + r, w0, w1, w2, w3);
    Real a0 = pa[0], a1 = pa[rs], a2 = pa[2 * rs], a3 = pa[3 * rs];
    a0 = Num<Real>::fma_(-w0, uc, Num<Real>::fma_(-u0, wc, a0));
    a1 = Num<Real>::fma_(-w1, uc, Num<Real>::fma_(-u1, wc, a1));
    a2 = Num<Real>::fma_(-w2, uc, Num<Real>::fma_(-uu2, wc, a2));
    a3 = Num<Real>::fma_(-w3, uc, Num<Real>::fma_(-u3, wc, a3));
    if (WITH_P) {
      Real x0, x1, x2, x3;
      load4(u2 + r, x0, x1, x2, x3);
      s0 += a0 * x0;
      s1 += a1 * x1;
      s2 += a2 * x2;
      s3 += a3 * x3;
    }
    pa[0] = a0;
    pa[rs] = a1;
    pa[2 * rs] = a2;
    pa[3 * rs] = a3;
  }
FS_PRAGMA(unroll 1)
  for (; r < re; ++r) {  // re % 4 rows (the compiler cannot see that it is < 4: keep it rolled)
    const Real x = Num<Real>::fma_(-w[r], uc, Num<Real>::fma_(-u[r], wc, a[r * rs + c * cs]));
    if (WITH_P) s0 += x * u2[r];
    a[r * rs + c * cs] = x;
  }
  return (s0 + s1) + (s2 + s3);
}

// One pass over columns c in [c0, n), rows [r4, n) (r4 a multiple of 4): A <- A - u w^T - w u^T
// (both triangles, so columns stay contiguous) and, with WITH_P, p2[c] = tau2 * sum_r A_new[r][c]
// u2[r] for the next reflector. One column per member: column access is bank-conflict free on the
// GPU.
template <bool WITH_P, int kRowStride = 0, class Team, class Real>
FS_HD void update_trailing(const Team& team, int c0, int r4, int n, Work<Real> wk, const Real* u, const Real* w,
                           const Real* u2, Real tau2, Real* p2) {
  for (int c = c0 + team.rank(); c < n; c += team.size()) {
    const Real s = update_rows<WITH_P, kRowStride>(wk, c, r4, n, u, w, u2);
    if (WITH_P) p2[c] = tau2 * s;
  }
}

// w = p - (tau/2)(p.u) u on [r0, n), in place over p; w = 0 on [r0 & ~3, r0). Ends with a barrier.
template <class Team, class Real>
FS_HD void finish_w(const Team& team, int r0, int n, Real tau, const Real* u, Real* p) {
  Real local = 0;
  for (int c = r0 + team.rank(); c < n; c += team.size()) local += p[c] * u[c];
  const Real half_tau_pu = Real(0.5) * tau * team.sum(local);
  for (int c = (r0 & ~3) + team.rank(); c < n; c += team.size()) p[c] = c < r0 ? Real(0) : p[c] - half_tau_pu * u[c];
  FS_SYNC(team);
}

// Step 3: A <- Q^T A Q tridiagonal; writes d[0..n-1], e[0..n-2]. Destroys wk.a, v, w, v2, p2.
// Reflector j acts on rows/columns j+1..n-1. Iteration j: finish the pending reflector j-1's w,
// apply its update to column j, build reflector j from that column, then one fused pass applies
// reflector j-1's update to columns > j while computing reflector j's p. Reflector -1 is the
// identity (u = w = 0: its "update" subtracts exact zeros), so the first iteration needs no
// special code. 5 barriers per reflector.
template <class Team, class Real>
FS_HD void tridiagonalize(const Team& team, int n, Work<Real> wk) {
  Real *u = wk.v, *w = wk.w, *u2 = wk.v2, *p2 = wk.p2;
  for (int i = team.rank(); i < n; i += team.size()) { u[i] = 0; w[i] = 0; }
  FS_SYNC(team);
  Real tau = 0;
  for (int j = 0; j + 2 < n; ++j) {
    FS_PHASE(team, kPhaseReflector);
    if (j > 0) finish_w(team, j, n, tau, u, w);  // reflector j-1's w, rows >= j
    update_column(team, j, n, wk, u, w);
    FS_SYNC(team);
    const Real tau2 = make_reflector(team, j, n, wk, u2);
    FS_SYNC(team);
    FS_PHASE(team, kPhaseUpdate);
    if (wk.rs == kPaddedRows128)  // uniform; the aimed-for size gets constant row offsets
      update_trailing<true, kPaddedRows128>(team, j + 1, j & ~3, n, wk, u, w, u2, tau2, p2);
    else
      update_trailing<true>(team, j + 1, j & ~3, n, wk, u, w, u2, tau2, p2);
    FS_SYNC(team);  // unseen: redundant, finish_w's reduction (a barrier) comes first in the next step; kept in the kernel measured 2026-11-26
    Real* t = u; u = u2; u2 = t;
    t = w; w = p2; p2 = t;
    tau = tau2;
  }
  // the last reflector (n-3) still has to reach the trailing 2 x 2 block
  FS_PHASE(team, kPhaseReflector);
  const int last = n >= 2 ? n - 2 : 0;
  if (n >= 3) finish_w(team, last, n, tau, u, w);
  update_trailing<false>(team, last, last & ~3, n, wk, u, w, u2, Real(0), p2);
  FS_SYNC(team);
  if (team.rank() == 0) {
    const Real* a = wk.a;
    const int rs = wk.rs, cs = wk.cs;
    if (n >= 2) {
      wk.d[n - 2] = a[(n - 2) * rs + (n - 2) * cs];
      wk.e[n - 2] = a[(n - 1) * rs + (n - 2) * cs];
    }
    wk.d[n - 1] = a[(n - 1) * rs + (n - 1) * cs];
  }
  FS_SYNC(team);
}

// Two consecutive entries, 8-byte (fp32) / 16-byte (fp64) aligned on the device: one load.
FS_HD void load2(const float* p, float& x0, float& x1) {
#if defined(__CUDA_ARCH__)
  const float2 q = *reinterpret_cast<const float2*>(p);
  x0 = q.x; x1 = q.y;
#else
  x0 = p[0]; x1 = p[1];
#endif
}
FS_HD void load2(const double* p, double& x0, double& x1) {
#if defined(__CUDA_ARCH__)
  const double2 q = *reinterpret_cast<const double2*>(p);
  x0 = q.x; x1 = q.y;
#else
  x0 = p[0]; x1 = p[1];
#endif
}

// One step of the Sturm recurrence, q' = (d - x) - e^2 / q with t = d - x, and the count's sign
// test: the block algorithm's (Num's division and sign bit). An algorithm may bring its own
// (eig_split.h's float64 step has no IEEE division).
template <class Real> struct SturmStep {
  static FS_HD Real step(Real q, Real e2, Real t) { return t - Num<Real>::sturm_div(e2, q); }
  static FS_HD int negative(Real q) { return Num<Real>::negative(q); }
};

// Number of eigenvalues of T smaller than x. T is given as pairs te[2i] = e_{i-1}^2 (e_{-1} = 0),
// te[2i+1] = d_i: one (broadcast) load per step. Zero pivots are replaced by -pivmin (xLAEBZ),
// which keeps the count monotone in x and finite.
template <class Real, class Step = SturmStep<Real>>
FS_HD int sturm_count(const Real* te, int n, Real x, Real pivmin) {
  Real q = te[1] - x;
  q = Num<Real>::abs_(q) <= pivmin ? -pivmin : q;
  int count = Step::negative(q);
  for (int i = 1; i < n; ++i) {
    Real e2, d;
    load2(te + 2 * i, e2, d);
    q = Step::step(q, e2, d - x);
    q = Num<Real>::abs_(q) <= pivmin ? -pivmin : q;  // never 0 or NaN after this
    count += Step::negative(q);
  }
  return count;
}

// Grid point g in [0, cells] of [lo, hi]; the same expression wherever it is evaluated.
template <class Real> FS_HD Real grid_point(Real lo, Real hi, int g, int cells = kGrid) {
  return g == cells ? hi : lo + (hi - lo) * (Real(g) * (Real(1) / cells));
}

// The (e^2, d) pairs of the Sturm recurrence from T's d and e: te[2i] = e_{i-1}^2 (e_{-1} = 0),
// te[2i+1] = d_i, written by the team (2n contiguous reals). No barrier.
template <class Team, class Real>
FS_HD void sturm_pairs(const Team& team, const Real* d, const Real* e, int n, Real* te) {
  for (int i = team.rank(); i < n; i += team.size()) {
    te[2 * i] = i > 0 ? e[i - 1] * e[i - 1] : Real(0);
    te[2 * i + 1] = d[i];
  }
}

// Where T's eigenvalues lie and how far to bisect: the Gerschgorin interval [lo, hi] widened by
// xSTEBZ's safety margin, the zero-pivot guard pivmin, and the final width tol = eps ||T||
// (error <= eps/2 ||T||). O(n) on every member, identical everywhere: no barrier needed.
template <class Real> struct Bracket {
  Real lo, hi, pivmin, tol;
};
template <class Real> FS_HD Bracket<Real> gerschgorin(const Real* d, const Real* e, int n) {
  const Real eps = Num<Real>::eps();
  Real lo = d[0], hi = d[0], e2max = 0;
  for (int i = 0; i < n; ++i) {
    const Real radius = (i > 0 ? Num<Real>::abs_(e[i - 1]) : Real(0)) + (i + 1 < n ? Num<Real>::abs_(e[i]) : Real(0));
    lo = (d[i] - radius < lo) ? d[i] - radius : lo;
    hi = (d[i] + radius > hi) ? d[i] + radius : hi;
    if (i + 1 < n && e[i] * e[i] > e2max) e2max = e[i] * e[i];
  }
  const Real pivmin = Num<Real>::tiny() * (e2max > 1 ? e2max : Real(1));
  const Real tnorm = Num<Real>::abs_(lo) > Num<Real>::abs_(hi) ? Num<Real>::abs_(lo) : Num<Real>::abs_(hi);
  const Real widen = Real(2.1) * (tnorm * eps * n + 2 * pivmin);  // xSTEBZ's safety margin
  return Bracket<Real>{lo - widen, hi + widen, pivmin, eps * tnorm};
}

// The k-th smallest eigenvalue (k from 0) by bisection, from the team's grid pass: counts[g] is
// the number of eigenvalues below grid point g of [lo, hi] for the interior points (count(lo) =
// 0, count(hi) = n). A binary search over the grid brackets it (count(glo) <= k < count(ghi); a
// count that rounding made non-monotone still leaves a valid bracket), then `count(x)` halves
// the bracket to width tol. 2 + log2((hi - lo) / tol) halvings suffice; the cap only guards
// against broken arithmetic.
template <class Real, class Count>
FS_HD Real bisect_from_grid(int k, const Real* counts, Real lo, Real hi, Real tol, Count count) {
  const int max_iter = 2 * (sizeof(Real) * 8 + 16);
  int glo = 0, ghi = kGrid;
  while (ghi - glo > 1) {
    const int g = (glo + ghi) >> 1;
    if (counts[g] > Real(k)) ghi = g; else glo = g;
  }
  Real a = grid_point(lo, hi, glo), b = grid_point(lo, hi, ghi);
  for (int it = 0; it < max_iter && b - a > tol; ++it) {
    const Real mid = a + Real(0.5) * (b - a);
    if (!(mid > a && mid < b)) break;  // interval is down to adjacent floats
    if (count(mid) > k) b = mid; else a = mid;
  }
  return a + Real(0.5) * (b - a);
}

// Steps 4-5: eigenvalues of T, ascending, into wk.d[0..n-1]. Needs d, e from tridiagonalize.
// Buffers: (e^2, d) pairs in v..w (2n contiguous), grid counts in p2, eigenvalues in v2.
template <class Team, class Real>
FS_HD void bisect_all(const Team& team, int n, Work<Real> wk) {
  Real* te = wk.v;
  Real* counts = wk.p2;  // counts at the interior grid points, as Reals (exact: n < 2^24)
  Real* lam = wk.v2;
  FS_PHASE(team, kPhaseIsolate);
  sturm_pairs(team, wk.d, wk.e, n, te);
  const Bracket<Real> br = gerschgorin(wk.d, wk.e, n);
  FS_SYNC(team);  // te complete
  // counts at the grid's interior points, one per member per kGrid / size
  for (int g = 1 + team.rank(); g < kGrid; g += team.size())
    counts[g] = Real(sturm_count(te, n, grid_point(br.lo, br.hi, g), br.pivmin));
  FS_SYNC(team);
  FS_PHASE(team, kPhaseRefine);
  for (int k = team.rank(); k < n; k += team.size())  // k-th smallest eigenvalue
    lam[k] = bisect_from_grid(k, counts, br.lo, br.hi, br.tol,
                              [&](Real x) { return sturm_count(te, n, x, br.pivmin); });
  FS_SYNC(team);
  FS_PHASE(team, kPhaseSort);
  // counts are monotone in exact arithmetic; rounding may still swap neighbours: rank sort
  // (position of lam[k] = #smaller + #equal before k), O(n) broadcast reads per member
  for (int k = team.rank(); k < n; k += team.size()) {
    const Real x = lam[k];
    int pos = 0;
    for (int i = 0; i < n; ++i) pos += (lam[i] < x) || (lam[i] == x && i < k);
    wk.d[pos] = x;  // d was copied into te
  }
  FS_SYNC(team);  // unseen: only a rank sort that moves an eigenvalue (rounding swapped neighbours) writes another member's d
}

// The whole solver for one matrix: in [n, n] (strides sr, sc) -> out[0..n-1] ascending.
template <class Team, class Real>
FS_HD void eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out,
                        Work<Real> wk) {
  FS_PHASE(team, kPhaseLoad);
  const Real amax = load_lower(team, in, sr, sc, n, wk);
  if (!(amax <= Num<Real>::huge()) || amax == 0) {  // uniform branch: amax is team-wide
    const Real fill = amax == 0 ? Real(0) : Num<Real>::nan_();
    for (int i = team.rank(); i < n; i += team.size()) out[i] = fill;
    FS_SYNC(team);  // wk is reused by the next matrix of this team
    FS_PHASE(team, kPhaseEnd);
    return;
  }
  int ex = 0;
  Num<Real>::frexp_(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)
  FS_SYNC(team);  // unseen: redundant after load_lower's team.max (a barrier)
  scale_matrix(team, n, ex, wk);
  FS_SYNC(team);  // unseen: redundant, tridiagonalize begins with a barrier before it reads the matrix
  tridiagonalize(team, n, wk);
  bisect_all(team, n, wk);
  for (int i = team.rank(); i < n; i += team.size()) out[i] = Num<Real>::ldexp_(wk.d[i], ex);
  FS_SYNC(team);  // unseen: redundant, the next matrix writes d only after several barriers
  FS_PHASE(team, kPhaseEnd);
}

// --- the algorithm interface ------------------------------------------------------------------
// Every algorithm of the kernel (eig_algos.h lists them) provides three functions of this shape:
//   <name>_threads(n)      the team size for an n x n matrix (the CUDA block);
//   <name>_smem_elems(n)   reals of team-shared work memory (the reduction scratch comes after it);
//   <name>_eigvalsh_one(team, in, sr, sc, n, out, smem)   one matrix, as eigvalsh_one.
// This file's algorithm, "block", is the reference of the others: the matrix in shared memory with
// padded rows, one thread per column (eig_kernel.cu's header has its cost model).
FS_HD constexpr int block_threads(int n) { return (n + 31) / 32 * 32 < kMaxThreads ? (n + 31) / 32 * 32 : kMaxThreads; }
FS_HD constexpr int64_t block_smem_elems(int n) { return block_work_elems(n, true); }
template <class Team, class Real>
FS_HD void block_eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  eigvalsh_one(team, in, sr, sc, n, out, block_work(smem, static_cast<Real*>(nullptr), n));
}

}  // namespace fastspec
