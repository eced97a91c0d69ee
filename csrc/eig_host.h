// eig_host.h — the host twin of the CUDA eigensolver: the same eig_core.h numerics, run serially.
#pragma once

#include <cstdint>
#include <vector>

namespace fastspec {

// The CUDA kernel's layout contract (fastspec_eigvalsh, eig_kernel.cu), on host memory:
// in + b*sb holds matrix b, element (r, c) at r*sr + c*sc (lower triangle read); out + b*osb its
// n eigenvalues, ascending. Strides in elements.
void host_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);
void host_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr, int64_t sc,
                       int64_t osb);

// Tests only: algorithm `algo` of eig_algos.h run by a team of ranks (fibers) with the CUDA kernel's
// team size, shared-memory layout, barriers and reduction order (eig_host.cpp). schedule: 0
// concurrent (two OS threads at once), 1 one rank at a time in rank order, 2 in reverse rank
// order. drop: the index of the FS_SYNC barrier every rank leaves out (-1: none). Returns the source line of every FS_SYNC barrier passed, in
// order; with record = kRecordPhases instead every FS_PHASE mark rank 0 made, barriers included (the
// sequence the kernel's profiling build stamps). Slow next to the one-thread twin: a 256-rank team
// switches ranks 256 times at each of its ~1,000 barriers per 128 x 128 matrix.
constexpr int kRecordSites = 0, kRecordPhases = 1;
std::vector<int> team_eigvalsh_f32(const float* in, float* out, int64_t batch, int n, int64_t sb, int64_t sr,
                                   int64_t sc, int64_t osb, int algo, int schedule, int64_t drop, int record);
std::vector<int> team_eigvalsh_f64(const double* in, double* out, int64_t batch, int n, int64_t sb, int64_t sr,
                                   int64_t sc, int64_t osb, int algo, int schedule, int64_t drop, int record);

}  // namespace fastspec
