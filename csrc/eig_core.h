// eig_core.h — per-matrix numerics of fastspec's batched symmetric eigensolver, compiled for
// both host and device: the CUDA kernel (eig_cuda.cu) and the host twin (eig_host.cpp) run
// exactly this code, so CPU-only CI checks the algorithm itself.
//
// Design envelope: eigenvalues only, real symmetric, n <= 256 (tuned for n = 128), float or
// double. One "team" per matrix: a CUDA thread block on the device, a single thread on the host.
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
//      symmetric rank-2 updates): A = Q T Q^T.  ~2 n^3 flops (4.2 MFLOP at n = 128).
//   4. eigenvalues of T by Sturm-count bisection, one eigenvalue per team member (xSTEBZ-style
//      pivmin guard against zero pivots; Gerschgorin start interval; absolute tolerance
//      eps * ||T||, iteration count hard-capped, so it always terminates).  ~n^2 * 26 * 4 ops.
//   5. ascending order enforced (insertion sort of an almost-sorted list), scale back.
// Error: backward stable, |lambda - lambda_exact| <= c(n) * eps * ||A||_2, like LAPACK xSYEVD.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FS_HD __host__ __device__ __forceinline__
#else
#define FS_HD inline
#endif

namespace fastspec {

// Real-type traits: machine constants and overloads that resolve the same on host and device.
template <class Real> struct Num;
template <> struct Num<float> {
  static FS_HD float eps() { return FLT_EPSILON * 0.5f; }  // unit round-off
  static FS_HD float tiny() { return FLT_MIN; }
  static FS_HD float huge() { return FLT_MAX; }
  static FS_HD float sqrt_(float x) { return sqrtf(x); }
  static FS_HD float abs_(float x) { return fabsf(x); }
  static FS_HD float copysign_(float m, float s) { return copysignf(m, s); }
  static FS_HD float ldexp_(float x, int e) { return ldexpf(x, e); }
  static FS_HD float frexp_(float x, int* e) { return frexpf(x, e); }
  static FS_HD float nan_() { return NAN; }
};
template <> struct Num<double> {
  static FS_HD double eps() { return DBL_EPSILON * 0.5; }
  static FS_HD double tiny() { return DBL_MIN; }
  static FS_HD double huge() { return DBL_MAX; }
  static FS_HD double sqrt_(double x) { return sqrt(x); }
  static FS_HD double abs_(double x) { return fabs(x); }
  static FS_HD double copysign_(double m, double s) { return copysign(m, s); }
  static FS_HD double ldexp_(double x, int e) { return ldexp(x, e); }
  static FS_HD double frexp_(double x, int* e) { return frexp(x, e); }
  static FS_HD double nan_() { return NAN; }
};

// The serial team used by the host twin.
struct HostTeam {
  int rank() const { return 0; }
  int size() const { return 1; }
  void sync() const {}
  template <class Real> Real sum(Real x) const { return x; }
  template <class Real> Real max(Real x) const { return x; }
};

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

// Work arrays of one matrix: a[n * n] plus four vectors of n.
template <class Real> struct Work {
  Real* a;   // full symmetric copy, element (r, c) at a[r * rs + c * cs], dense n x n
  int rs, cs;  // device: row-major (rs = n, cs = 1): a block's threads walk consecutive columns,
               // bank-conflict free. host: column-major (rs = 1, cs = n): the inner loops over r
               // are contiguous and vectorize. Same arithmetic either way, only the layout differs.
  Real* d;   // diagonal of T
  Real* e;   // off-diagonal of T (e[i] couples i, i+1)
  Real* v;   // Householder vector, later e^2; 16-byte aligned (load4)
  Real* w;   // A v, then w = p - (tau/2)(p.v) v, then the eigenvalues; 16-byte aligned
};

// Step 1: mirror the lower triangle of in (strides sr, sc in elements) into wk.a.
// Returns max |a_ij| over the lower triangle, +inf if any entry there is NaN/Inf.
template <class Team, class Real>
FS_HD Real load_lower(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Work<Real> wk) {
  Real local = 0;
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t idx = team.rank(); idx < nn; idx += team.size()) {
    const int r = static_cast<int>(idx / n), c = static_cast<int>(idx % n);
    if (c > r) continue;  // the strict upper triangle is never read (torch UPLO='L' semantics)
    const Real x = in[r * sr + c * sc];
    wk.a[r * wk.rs + c * wk.cs] = x;
    wk.a[c * wk.rs + r * wk.cs] = x;
    const Real ax = Num<Real>::abs_(x);
    local = (ax <= Num<Real>::huge()) ? (ax > local ? ax : local) : INFINITY;  // NaN fails <=
  }
  return team.max(local);
}

// Step 3: A <- Q^T A Q tridiagonal; writes d[0..n-1], e[0..n-2]. Destroys wk.a.
template <class Team, class Real>
FS_HD void tridiagonalize(const Team& team, int n, Work<Real> wk) {
  Real* a = wk.a;
  const int rs = wk.rs, cs = wk.cs, me = team.rank(), nt = team.size();
  for (int k = 0; k + 2 < n; ++k) {
    const int r0 = k + 1;  // the reflector acts on rows/columns r0..n-1
    // x = a[r0:, k]; H = I - tau u u^T with u = [1, x[1:] / (alpha - beta)] maps x to beta e1
    Real local = 0;
    for (int i = r0 + 1 + me; i < n; i += nt) local += a[i * rs + k * cs] * a[i * rs + k * cs];
    const Real sigma = team.sum(local);
    const Real alpha = a[r0 * rs + k * cs];
    Real beta = alpha, tau = 0, inv = 0;
    if (sigma > 0) {  // uniform: sigma is the same on every member
      beta = -Num<Real>::copysign_(Num<Real>::sqrt_(alpha * alpha + sigma), alpha);
      tau = (beta - alpha) / beta;
      inv = Real(1) / (alpha - beta);
    }
    if (me == 0) { wk.d[k] = a[k * rs + k * cs]; wk.e[k] = beta; }
    if (tau == 0) { team.sync(); continue; }  // x already a multiple of e1 (or underflowed to 0)
    // loops over r start at the aligned r4 <= r0 (load4); u = w = 0 on [r4, r0) makes the extra
    // terms exact no-ops (the stale entries there are finite)
    const int r4 = r0 & ~3;
    for (int i = r4 + me; i < n; i += nt) {
      wk.v[i] = i < r0 ? Real(0) : (i == r0 ? Real(1) : a[i * rs + k * cs] * inv);
      if (i < r0) wk.w[i] = 0;
    }
    team.sync();
    // p = tau * A22 u, one column per member: column access is bank-conflict free on the GPU.
    // Four interleaved partial sums: four independent FMA chains (GPU latency) and a rounding
    // error bound growing with n/4 terms instead of n.
    for (int c = r0 + me; c < n; c += nt) {
      Real s0 = 0, s1 = 0, s2 = 0, s3 = 0, v0, v1, v2, v3;
      int r = r4;
      for (; r + 3 < n; r += 4) {
        load4(wk.v + r, v0, v1, v2, v3);
        s0 += a[r * rs + c * cs] * v0;
        s1 += a[(r + 1) * rs + c * cs] * v1;
        s2 += a[(r + 2) * rs + c * cs] * v2;
        s3 += a[(r + 3) * rs + c * cs] * v3;
      }
      for (; r < n; ++r) s0 += a[r * rs + c * cs] * wk.v[r];
      wk.w[c] = tau * ((s0 + s1) + (s2 + s3));
    }
    local = 0;
    for (int c = r0 + me; c < n; c += nt) local += wk.w[c] * wk.v[c];
    const Real half_tau_pv = Real(0.5) * tau * team.sum(local);
    for (int c = r0 + me; c < n; c += nt) wk.w[c] -= half_tau_pv * wk.v[c];
    team.sync();
    // A22 <- A22 - u w^T - w u^T (both triangles, so columns stay contiguous for the next p)
    for (int c = r0 + me; c < n; c += nt) {
      const Real vc = wk.v[c], wc = wk.w[c];
      Real v0, v1, v2, v3, w0, w1, w2, w3;
      int r = r4;
      for (; r + 3 < n; r += 4) {
        load4(wk.v + r, v0, v1, v2, v3);
        load4(wk.w + r, w0, w1, w2, w3);
        a[r * rs + c * cs] -= v0 * wc + w0 * vc;
        a[(r + 1) * rs + c * cs] -= v1 * wc + w1 * vc;
        a[(r + 2) * rs + c * cs] -= v2 * wc + w2 * vc;
        a[(r + 3) * rs + c * cs] -= v3 * wc + w3 * vc;
      }
      for (; r < n; ++r) a[r * rs + c * cs] -= wk.v[r] * wc + wk.w[r] * vc;
    }
    team.sync();
  }
  if (me == 0) {
    if (n >= 2) {
      wk.d[n - 2] = a[(n - 2) * rs + (n - 2) * cs];
      wk.e[n - 2] = a[(n - 1) * rs + (n - 2) * cs];
    }
    wk.d[n - 1] = a[(n - 1) * rs + (n - 1) * cs];
  }
  team.sync();
}

// Number of eigenvalues of T (diagonal d, squared off-diagonal e2) smaller than x. Zero pivots
// are replaced by -pivmin (xLAEBZ), which keeps the count monotone in x and finite.
template <class Real>
FS_HD int sturm_count(const Real* d, const Real* e2, int n, Real x, Real pivmin) {
  Real q = d[0] - x;
  if (Num<Real>::abs_(q) <= pivmin) q = -pivmin;
  int count = q < 0;
  for (int i = 1; i < n; ++i) {
    q = (d[i] - x) - e2[i - 1] / q;
    if (Num<Real>::abs_(q) <= pivmin) q = -pivmin;
    count += q < 0;
  }
  return count;
}

// Steps 4-5: eigenvalues of T into w[0..n-1], ascending. Needs d, e from tridiagonalize.
template <class Team, class Real>
FS_HD void bisect_all(const Team& team, int n, Work<Real> wk) {
  const Real eps = Num<Real>::eps();
  Real* e2 = wk.v;
  for (int i = team.rank(); i + 1 < n; i += team.size()) e2[i] = wk.e[i] * wk.e[i];
  team.sync();
  // Gerschgorin interval and pivmin: O(n) per member, identical everywhere, no barrier needed
  Real lo = wk.d[0], hi = wk.d[0], e2max = 0;
  for (int i = 0; i < n; ++i) {
    const Real radius = (i > 0 ? Num<Real>::abs_(wk.e[i - 1]) : Real(0)) +
                        (i + 1 < n ? Num<Real>::abs_(wk.e[i]) : Real(0));
    lo = (wk.d[i] - radius < lo) ? wk.d[i] - radius : lo;
    hi = (wk.d[i] + radius > hi) ? wk.d[i] + radius : hi;
    if (i + 1 < n && e2[i] > e2max) e2max = e2[i];
  }
  const Real pivmin = Num<Real>::tiny() * (e2max > 1 ? e2max : Real(1));
  const Real tnorm = Num<Real>::abs_(lo) > Num<Real>::abs_(hi) ? Num<Real>::abs_(lo) : Num<Real>::abs_(hi);
  const Real widen = Real(2.1) * (tnorm * eps * n + 2 * pivmin);  // xSTEBZ's safety margin
  lo -= widen;
  hi += widen;
  const Real tol = eps * tnorm;  // final interval width: bisection error <= eps/2 * ||T||
  // 2 + log2((hi - lo) / tol) halvings suffice; the cap only guards against broken arithmetic
  const int max_iter = 2 * (sizeof(Real) * 8 + 16);
  for (int k = team.rank(); k < n; k += team.size()) {  // k-th smallest eigenvalue
    Real a = lo, b = hi;
    for (int it = 0; it < max_iter && b - a > tol; ++it) {
      const Real mid = a + Real(0.5) * (b - a);
      if (!(mid > a && mid < b)) break;  // interval is down to adjacent floats
      if (sturm_count(wk.d, e2, n, mid, pivmin) > k) b = mid; else a = mid;
    }
    wk.w[k] = a + Real(0.5) * (b - a);
  }
  team.sync();
  if (team.rank() == 0) {  // counts are monotone in exact arithmetic; make sure rounding agrees
    for (int i = 1; i < n; ++i) {
      const Real x = wk.w[i];
      int j = i - 1;
      while (j >= 0 && wk.w[j] > x) { wk.w[j + 1] = wk.w[j]; --j; }
      wk.w[j + 1] = x;
    }
  }
  team.sync();
}

// The whole solver for one matrix: in [n, n] (strides sr, sc) -> out[0..n-1] ascending.
template <class Team, class Real>
FS_HD void eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out,
                        Work<Real> wk) {
  const Real amax = load_lower(team, in, sr, sc, n, wk);
  if (!(amax <= Num<Real>::huge()) || amax == 0) {  // uniform branch: amax is team-wide
    const Real fill = amax == 0 ? Real(0) : Num<Real>::nan_();
    for (int i = team.rank(); i < n; i += team.size()) out[i] = fill;
    team.sync();  // wk is reused by the next matrix of this team
    return;
  }
  int ex = 0;
  Num<Real>::frexp_(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)
  const int64_t nn = static_cast<int64_t>(n) * n;
  team.sync();
  for (int64_t idx = team.rank(); idx < nn; idx += team.size()) {
    wk.a[idx] = Num<Real>::ldexp_(wk.a[idx], -ex);
  }
  team.sync();
  tridiagonalize(team, n, wk);
  bisect_all(team, n, wk);
  for (int i = team.rank(); i < n; i += team.size()) out[i] = Num<Real>::ldexp_(wk.w[i], ex);
  team.sync();
}

}  // namespace fastspec
