// eig_algos.h — the algorithms of the batched eigensolver, one compile-time choice per kernel
// variant (eig_kernel.cu's FS_ALGO) and a run-time choice in the team emulation (eig_host.cpp).
// Each algorithm lives in its own header, beside the shared building blocks of eig_core.h, and
// provides the interface described at the end of eig_core.h. Which one runs on a GPU is decided
// by measurement (fastspec/eig/variants.py and its table selection.json); the ids below are
// fastspec/eig/variants.py's ALGOS, checked equal by tests/test_eig_variants.py.
#pragma once

#include "eig_core.h"
#include "eig_packed.h"
#include "eig_regs.h"
#include "eig_split.h"
#include "eig_newton.h"

namespace fastspec {

enum Algo : int { kAlgoBlock = 0, kAlgoPacked = 1, kAlgoRegs = 2, kAlgoSplit = 3, kAlgoNewton = 4, kAlgoCount = 5 };

FS_HD constexpr int algo_threads(int algo, int n) {
  return algo == kAlgoPacked ? packed_threads(n)
       : algo == kAlgoRegs   ? regs_threads(n)
       : algo == kAlgoSplit  ? split_threads(n)
       : algo == kAlgoNewton ? newton_threads(n)
                             : block_threads(n);
}

FS_HD constexpr int64_t algo_smem_elems(int algo, int n) {
  return algo == kAlgoPacked ? packed_smem_elems(n)
       : algo == kAlgoRegs   ? regs_smem_elems(n)
       : algo == kAlgoSplit  ? split_smem_elems(n)
       : algo == kAlgoNewton ? newton_smem_elems(n)
                             : block_smem_elems(n);
}

// Largest n an algorithm's team and data layout take (shared memory is the launcher's check).
FS_HD constexpr int algo_max_n(int algo) {
  return algo == kAlgoPacked ? kPackedMaxN
       : algo == kAlgoRegs   ? kRegsMaxN
       : algo == kAlgoSplit  ? kSplitMaxN
       : algo == kAlgoNewton ? kNewtonMaxN
                             : kMaxN;
}

// The kernel's choice, at compile time: only the chosen algorithm is instantiated.
template <int A, class Team, class Real>
FS_HD void algo_eigvalsh_one(const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out, Real* smem) {
  if constexpr (A == kAlgoPacked) packed_eigvalsh_one(team, in, sr, sc, n, out, smem);
  else if constexpr (A == kAlgoRegs) regs_eigvalsh_one(team, in, sr, sc, n, out, smem);
  else if constexpr (A == kAlgoSplit) split_eigvalsh_one(team, in, sr, sc, n, out, smem);
  else if constexpr (A == kAlgoNewton) newton_eigvalsh_one(team, in, sr, sc, n, out, smem);
  else block_eigvalsh_one(team, in, sr, sc, n, out, smem);
}

// The team emulation's choice, at run time.
template <class Team, class Real>
FS_HD void algo_eigvalsh_one(int algo, const Team& team, const Real* in, int64_t sr, int64_t sc, int n, Real* out,
                             Real* smem) {
  switch (algo) {
    case kAlgoPacked: packed_eigvalsh_one(team, in, sr, sc, n, out, smem); break;
    case kAlgoRegs: regs_eigvalsh_one(team, in, sr, sc, n, out, smem); break;
    case kAlgoSplit: split_eigvalsh_one(team, in, sr, sc, n, out, smem); break;
    case kAlgoNewton: newton_eigvalsh_one(team, in, sr, sc, n, out, smem); break;
    default: block_eigvalsh_one(team, in, sr, sc, n, out, smem); break;
  }
}

}  // namespace fastspec
