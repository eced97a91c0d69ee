// eig_host.h — the host twin of the CUDA eigensolver: the same eig_core.h numerics, run serially.
#pragma once

#include <cstdint>

namespace fastspec {

// Same layout contract as cuda_eigvalsh_* (eig_cuda.h), on host memory.
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
