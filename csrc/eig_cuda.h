// eig_cuda.h — host-callable entry points of the CUDA batched eigensolver (eig_cuda.cu), kept
// free of CUDA headers so bindings.cpp compiles with the plain C++ compiler.
#pragma once

#include <cstdint>

namespace fastspec {

// Elements of device workspace cuda_eigvalsh_* needs for this problem (0: none).
int64_t cuda_workspace_elems(int64_t batch, int n, int elem_size, int device);

// in: batch matrices [n, n] at in + b*sb, element (r, c) at r*sr + c*sc (lower triangle read);
// out: batch vectors [n] at out + b*osb, contiguous, ascending. Strides in elements. Asynchronous
// on `stream` (a cudaStream_t); `device` is the ordinal the pointers live on.
void cuda_eigvalsh_f32(const float* in, float* out, float* work, int64_t batch, int n, int64_t sb, int64_t sr,
                       int64_t sc, int64_t osb, int device, void* stream);
void cuda_eigvalsh_f64(const double* in, double* out, double* work, int64_t batch, int n, int64_t sb, int64_t sr,
                       int64_t sc, int64_t osb, int device, void* stream);

int cuda_device_count();

}  // namespace fastspec
