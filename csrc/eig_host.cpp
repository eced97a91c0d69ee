// eig_host.cpp — host twin: eig_core.h with a one-thread team, matrix by matrix. It exists so
// CPU-only CI tests the solver's numerics (fastspec.eigvalsh(A, backend="host")); it is not
// tuned for speed (torch's LAPACK path is the CPU backend of choice).
#include "eig_host.h"

#include <vector>

#include "eig_core.h"

namespace fastspec {
namespace {

template <class Real>
void host_eigvalsh(const Real* in, Real* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc, int64_t osb) {
  std::vector<Real> buf(static_cast<size_t>(n) * n + 4 * static_cast<size_t>(n));
  Work<Real> wk;
  wk.rs = 1;
  wk.cs = n;
  wk.a = buf.data();
  wk.d = wk.a + static_cast<size_t>(n) * n;
  wk.e = wk.d + n;
  wk.v = wk.e + n;
  wk.w = wk.v + n;
  const HostTeam team;
  for (int64_t b = 0; b < batch; ++b) eigvalsh_one(team, in + b * sb, sr, sc, n, out + b * osb, wk);
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

}  // namespace fastspec
