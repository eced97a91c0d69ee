"""The eigensolver's limits and layout numbers: the one place they are written.

Python owns them; the C++ and CUDA sources (``csrc/``) receive them as preprocessor
macros and stop with ``#error`` when one is missing, so no source file can carry a copy of its own:

* NVRTC compiles the kernel with :func:`defines` in its options (:mod:`.nvrtc`);
* ``setup.py`` builds the host twin (``fastspec.eig._host``) with the same macros, read from this
  file without importing the package (no torch at build time): keep it free of imports;
* the host twin reports the values it was built with (``_host.MAX_N``, ...); :mod:`.native` treats
  a build whose values differ from these as stale and does not load it.

``tests/test_eig_limits.py`` checks that every consumer agrees with this file.
"""

MAX_N = 1024
"""Largest ``n`` of the native solvers (``solver="cuda"`` and ``"host"``): the CUDA block keeps six
vectors of ``n`` reals in shared memory beside the matrix (fp64 n = 1024: 48.5 KiB, within every
supported GPU's per-block opt-in), whichever memory holds the matrix itself. Macro ``FS_MAX_N``."""

AUTO_MAX_N = 256
"""Largest ``n`` that ``solver="auto"`` sends to the CUDA kernel (its design envelope, tuned for
n = 128); larger ``n`` go to ``torch.linalg.eigvalsh``. Python only (dispatch policy)."""

MAX_THREADS = 256
"""Largest CUDA block: ``round_up(n, 32)`` threads up to this, one matrix column each; larger ``n``
stride over the columns. The host team emulation uses as many ranks. Macro ``FS_MAX_THREADS``."""

GRID = 128
"""Cells of the bisection's first, team-wide Sturm-count pass (``eig_core.h``'s ``kGrid``): the
count vector ``p2`` holds ``max(n, GRID)`` reals, which the launcher's shared-memory size must
include. Macro ``FS_GRID``."""

SCRATCH = 64
"""Reals of reduction scratch after a block's work arrays: two alternating halves of one real per
warp (``BlockTeam::reduce``; 32 warps at most). Macro ``FS_SCRATCH``."""

MACROS = {"FS_MAX_N": MAX_N, "FS_MAX_THREADS": MAX_THREADS, "FS_GRID": GRID, "FS_SCRATCH": SCRATCH}
"""What the C++/CUDA sources are compiled with (name -> value)."""


def defines() -> list[str]:
    """:data:`MACROS` as compiler options: ``["-DFS_MAX_N=1024", ...]``."""
    return [f"-D{name}={value}" for name, value in MACROS.items()]
