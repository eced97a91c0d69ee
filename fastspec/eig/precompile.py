"""Fill the kernel cache ahead of time, for a GPU that need not be here: the CUDA eigensolver and
the exact covariance update's Gram kernel (``csrc/cov_gram.cu``).

    fastspec precompile --arch 90 [--n 64 128 256] [--dtype float32 float64] [--algo block|all|NAME...]
                        [--cov-d 64 128] [--jobs N]
    python -m fastspec.eig.precompile ...       # the same command

:func:`precompile` compiles, in parallel, the variants a GPU of compute capability ``arch`` would
compile at first use (the same plan as :mod:`.cuda`, from the arch's shared-memory table), for the
block algorithm or any others of :mod:`.variants` (``"all"``: every one that takes the size), into
``$FASTSPEC_CACHE`` (:mod:`.nvrtc`), and returns each one's time: for a container image or a
shared cluster cache built once, and for the GPU kit, which fills its cache before its timed
steps. With ``cov_d``, also the Gram kernel of :mod:`fastspec.covariance.gram_cuda` for those head
widths and every input dtype it takes (bf16, fp16, fp32, fp64): what the ``dmma`` route of an
exact covariance update compiles at its first use. The command line is
:mod:`fastspec.commands.precompile`.
"""
from __future__ import annotations

import sys

from . import nvrtc
from .cuda import DeviceSpec, variant_for
from .variants import ALGORITHMS

COV = "cov_gram"  # the algo field of a covariance Gram job in todo()'s list


def _compile_one(args: tuple[int, str, int, str]) -> tuple[str, str, float]:
    arch, dtype, n, algo = args
    if algo == COV:
        from ..covariance import gram_cuda  # noqa: PLC0415 - only when asked: keeps the eig path light

        tag = gram_cuda.tag(n, dtype)
        img = nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(n, dtype), tag, nvrtc.choose_target(arch))
        return f"{COV}-{tag}", img.origin, img.seconds
    img = nvrtc.compile_variant(variant_for(n, dtype, DeviceSpec.for_arch(arch), algo), nvrtc.choose_target(arch))
    return img.variant.tag, img.origin, img.seconds


def cov_todo(arch: int, widths) -> list[tuple[int, str, int, str]]:
    """``(arch, dtype, D, COV)`` of every covariance Gram kernel to compile: each head width of
    ``widths`` (ValueError outside the kernel's envelope) for every input dtype it takes."""
    from ..covariance import gram_cuda  # noqa: PLC0415

    out = []
    for D in dict.fromkeys(widths):
        why = gram_cuda.supports(D)
        if why:
            raise ValueError(f"cov-d: {why}")
        out += [(arch, dtype, D, COV) for dtype in gram_cuda.DTYPES]
    return out


def todo(arch: int, sizes, dtypes, algos=("block",)) -> list[tuple[int, str, int, str]]:
    """``(arch, dtype, n, algo)`` of every variant to compile: each algorithm of ``algos`` (names of
    :data:`.variants.ALGORITHMS`, or ``"all"``) for every size and dtype it takes and whose shared
    memory fits sm_``arch``. ValueError for an unknown name."""
    names = list(ALGORITHMS) if "all" in algos else list(dict.fromkeys(algos))
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"algo: expected names of {sorted(ALGORITHMS)} or 'all', got {unknown}")
    spec = DeviceSpec.for_arch(arch)
    out = []
    for a in names:
        for d in dtypes:
            for n in sizes:
                if not ALGORITHMS[a].takes(n, d):
                    continue
                try:
                    variant_for(n, d, spec, a)
                except ValueError:  # its shared memory does not fit this arch
                    continue
                out.append((arch, d, n, a))
    return out


def precompile(arch: int, sizes, dtypes, jobs: int = 1, algos=("block",), cov_d=()) -> list[tuple[str, str, float]]:
    """Compile the variant of every (algorithm in ``algos``, dtype in ``dtypes``, n in ``sizes``)
    for sm_``arch`` into the kernel cache (:func:`todo`), and the covariance Gram kernel of every
    head width in ``cov_d`` (:func:`cov_todo`), ``jobs`` processes at a time; ``(tag, origin,
    seconds)`` per image, where ``origin`` says whether NVRTC compiled it or the cache had it.
    Raises :class:`~.nvrtc.KernelUnavailable` when NVRTC cannot compile here."""
    work = todo(arch, sizes, dtypes, algos) + cov_todo(arch, cov_d)
    if jobs > 1 and len(work) > 1:
        from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

        with ProcessPoolExecutor(min(jobs, len(work))) as pool:
            return list(pool.map(_compile_one, work))
    return [_compile_one(j) for j in work]


def main(argv: list[str] | None = None) -> int:
    """``python -m fastspec.eig.precompile ARGS`` runs ``fastspec precompile ARGS``."""
    from ..cli import main as cli_main

    return cli_main(["precompile", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
