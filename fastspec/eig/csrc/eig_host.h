// eig_host.h — the host twin of the CUDA eigensolver: the same eig_core.h numerics, run serially.
#pragma once

#include <cstdint>

namespace fastspec {

// The CUDA kernel's layout contract (fastspec_eigvalsh, eig_kernel.cu), on host memory:
// in + b*sb holds matrix b, element (r, c) at r*sr + c*sc (lower triangle read); out + b*osb its
// n eigenvalues, ascending. Strides in elements.
void host_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);
void host_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);

// Tests only: the same numerics run by real threads with the CUDA kernel's team size, shared-memory
// layout, barriers and reduction order (eig_host.cpp). Slow: one thread per matrix column.
void team_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);
void team_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);

}  // namespace fastspec
