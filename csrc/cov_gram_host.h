// cov_gram_host.h — the host twin of the DMMA Gram kernel pair (cov_gram.cu): the kernels' own code
// compiled for the CPU and run on a software GPU (cov_gram_host.cpp). Tests only.
#pragma once

#include <cstdint>
#include <vector>

namespace fastspec {

// One compiled configuration of cov_gram.cu: its macros, as fastspec/covariance/gram_cuda.py's
// defines() sets them for (D, input dtype).
struct CovGramConfig {
  int d, in, rows, threads, min_blocks;  // FS_COV_D, FS_COV_IN, FS_COV_ROWS, FS_COV_THREADS, FS_COV_MIN_BLOCKS
};

// What one launch did, counted by the software GPU: blocks run, and the collectives resolved
// (__syncthreads per block, __all_sync and mma.m8n8k4 per warp), fiber switches.
struct CovGramStats {
  int64_t blocks = 0, syncthreads = 0, all_sync = 0, mma = 0, switches = 0;
};

// Whether the software GPU was built (it needs <ucontext.h>); without it cov_gram_launch throws.
extern const bool kCovGramTwin;

// The configurations compiled into the twin (every D of the envelope x every input dtype).
std::vector<CovGramConfig> cov_gram_configs();

// Entry points of cov_gram.cu, by index.
constexpr int kCovGramEntry = 0, kCovGramReduceEntry = 1;

// Launch entry `entry` of configuration `config` on the software GPU, on the calling OS thread:
// grid and block as a CUDA launch takes them, `smem` bytes of dynamic shared memory, `args` the
// kernel's parameters in order (pointers as integers; host memory). `order` 0 runs a block's
// threads in thread order, 1 in reverse (the results must not depend on it). Throws
// std::invalid_argument for a configuration not compiled or a malformed launch, std::runtime_error
// when a block deadlocks (a collective some thread never reaches), writes past its dynamic shared
// memory or the twin is not built.
CovGramStats cov_gram_launch(int entry, const CovGramConfig& config, const int64_t grid[3], const int64_t block[3],
                             int64_t smem, const std::vector<int64_t>& args, int order);

}  // namespace fastspec
