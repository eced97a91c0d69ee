"""Fill the CUDA eigensolver's kernel cache ahead of time, for a GPU that need not be here.

    fastspec precompile --arch 90 [--n 64 128 256] [--dtype float32 float64] [--jobs N]
    python -m fastspec.eig.precompile ...       # the same command

:func:`precompile` compiles, in parallel, the variants a GPU of compute capability ``arch`` would
compile at first use (the same plan as :mod:`.cuda`, from the arch's shared-memory table) into
``$FASTSPEC_CACHE`` (:mod:`.nvrtc`), and returns each one's time: for a container image or a
shared cluster cache built once, and for the GPU kit, which fills its cache before its timed
steps. The command line is :mod:`fastspec.commands.precompile`.
"""
from __future__ import annotations

import sys

from . import nvrtc
from .cuda import DeviceSpec, variant_for


def _compile_one(args: tuple[int, str, int]) -> tuple[str, str, float]:
    arch, dtype, n = args
    img = nvrtc.compile_variant(variant_for(n, dtype, DeviceSpec.for_arch(arch)), nvrtc.choose_target(arch))
    return img.variant.tag, img.origin, img.seconds


def precompile(arch: int, sizes, dtypes, jobs: int = 1) -> list[tuple[str, str, float]]:
    """Compile the variant of every (dtype in ``dtypes``, n in ``sizes``) for sm_``arch`` into the
    kernel cache, ``jobs`` processes at a time; ``(tag, origin, seconds)`` per variant, where
    ``origin`` says whether NVRTC compiled it or the cache had it. Raises
    :class:`~.nvrtc.KernelUnavailable` when NVRTC cannot compile here."""
    todo = [(arch, d, n) for d in dtypes for n in sizes]
    if jobs > 1 and len(todo) > 1:
        from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

        with ProcessPoolExecutor(min(jobs, len(todo))) as pool:
            return list(pool.map(_compile_one, todo))
    return [_compile_one(j) for j in todo]


def main(argv: list[str] | None = None) -> int:
    """``python -m fastspec.eig.precompile ARGS`` runs ``fastspec precompile ARGS``."""
    from ..cli import main as cli_main

    return cli_main(["precompile", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
