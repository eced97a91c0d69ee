"""Phase profile of the CUDA eigensolver: where one matrix's time goes, from the kernel's own clocks.

Nsight Compute times out on this kernel (every GPU run so far), and an instruction-count model
does not say where the time goes: it predicted ~1 ms for an algorithm that ran 2.9 ms. So the
kernel has a profiling build (``csrc/eig_kernel.cu`` with ``FS_PROFILE=1``; the normal build is
unchanged): member 0 of every block stamps ``clock64()`` with a phase id at each ``FS_PHASE`` mark of
the algorithm (``csrc/eig_core.h`` lists them), and every barrier counts as a phase of its own.
:func:`run_profiled` compiles that build through the same NVRTC path and cache as the solver,
launches it with a record buffer in place of the work pointer, and :func:`decode` turns the record
into cycles per phase per block; :func:`summarize` gives the median and p90 over the blocks.

The record (``eig_kernel.cu``'s layout, :data:`HEAD`, :data:`SLOTS`): per block ``SLOTS`` 64-bit
words; word 0 = ``(SM id << 32) | marks made``, word 1 = ``%globaltimer`` (ns) at the block's start,
word 2 at its end, then one word per mark, ``(phase << 56) | (clock64 & (2**56 - 1))``. The time
between two marks belongs to the first one's phase; a block's total is its first mark to its last
(``end``). The clocks are member 0's: a barrier phase is warp 0's wait for the slowest warp.

The phases (:data:`PHASES`, ids equal to ``eig_core.h``'s ``Phase``, checked by the tests):
``load`` (read, max, scale), ``reflector`` (reductions' arithmetic, the reflector's column, beta,
tau, u, w), ``update`` (the trailing pass: rank-2 update fused with the next product), ``product``
(a product pass of its own), ``barrier``, ``isolate`` (T's pairs, Gerschgorin, the grid counts),
``refine`` (each eigenvalue from its grid cell to its final width), ``sort`` (ascending order,
scaling back, the store), ``end``.

``benchmarks/eig_phases.py`` runs it per algorithm (GPU kit command 1) and prints the table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PHASES = ("load", "reflector", "update", "product", "barrier", "isolate", "refine", "sort", "end")
"""Phase names by id: ``csrc/eig_core.h``'s ``Phase`` enum (``_host.PHASES`` is the same map)."""
PHASE_ID = {name: i for i, name in enumerate(PHASES)}
HEAD = 3           # header words per block record (eig_kernel.cu's kProfHead)
SLOTS = 4096       # words per block record (kProfSlots)
CLOCK_BITS = 56    # a mark keeps the low 56 bits of clock64
CLOCK_MASK = (1 << CLOCK_BITS) - 1
OPTIONS = ("-DFS_PROFILE=1",)
"""The NVRTC options that make the profiling build (its own cache key: the normal image is untouched)."""


@dataclass(frozen=True)
class BlockProfile:
    """One block's record, decoded: SM cycles per phase (index = phase id) and how often the block
    entered each phase, its total cycles (first mark to ``end``), SM, and ``%globaltimer`` span."""

    sm: int
    marks: int
    cycles: np.ndarray          # [len(PHASES)] int64
    entries: np.ndarray         # [len(PHASES)] int64
    total: int
    start_ns: int
    end_ns: int
    truncated: bool             # more marks than the record holds: the phases cover a prefix

    @property
    def ns(self) -> int:
        return self.end_ns - self.start_ns


def decode_block(words: np.ndarray) -> BlockProfile:
    """One block's ``SLOTS`` words (uint64 or int64) -> :class:`BlockProfile`."""
    w = np.asarray(words).view(np.uint64) if np.asarray(words).dtype == np.int64 else np.asarray(words, np.uint64)
    if w.shape != (SLOTS,):
        raise ValueError(f"words: expected {SLOTS} words of one block record, got shape {tuple(w.shape)}")
    head = int(w[0])
    marks, sm = head & 0xFFFFFFFF, head >> 32
    kept = min(marks, SLOTS - HEAD)
    body = w[HEAD:HEAD + kept]
    ids = (body >> np.uint64(CLOCK_BITS)).astype(np.int64)
    clk = (body & np.uint64(CLOCK_MASK)).astype(np.int64)
    if kept and ids.max() >= len(PHASES):
        raise ValueError(f"words: phase id {int(ids.max())} unknown (PHASES has {len(PHASES)}): not a profile record")
    dur = (np.diff(clk) & CLOCK_MASK) if kept > 1 else np.zeros(0, np.int64)  # wraps at 2**56
    cycles = np.bincount(ids[:-1], weights=dur, minlength=len(PHASES)).astype(np.int64) if kept > 1 \
        else np.zeros(len(PHASES), np.int64)
    entries = np.bincount(ids, minlength=len(PHASES)).astype(np.int64) if kept else np.zeros(len(PHASES), np.int64)
    return BlockProfile(int(sm), int(marks), cycles, entries, int(dur.sum()), int(w[1]), int(w[2]), marks > kept)


def decode(record: np.ndarray) -> list[BlockProfile]:
    """The kernel's record ``[blocks, SLOTS]`` -> one :class:`BlockProfile` per block that ran
    (a block that made no mark, e.g. past the batch, is left out)."""
    rec = np.asarray(record)
    if rec.ndim != 2 or rec.shape[1] != SLOTS:
        raise ValueError(f"record: expected [blocks, {SLOTS}], got shape {tuple(rec.shape)}")
    out = []
    for row in rec:
        b = decode_block(row)
        if b.marks:
            out.append(b)
    return out


@dataclass
class Summary:
    """Per phase over the blocks: median and p90 cycles, the share of all cycles, entries per block;
    the block total's median and p90; the kernel's span and the blocks resident per SM on average."""

    blocks: int
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    total_median: float = 0.0
    total_p90: float = 0.0
    span_ns: int = 0
    resident: float = 0.0       # mean blocks resident on an SM while it had any
    ghz: float = 0.0            # SM clock: block cycles over block ns (median)
    truncated: int = 0          # blocks whose record was too short

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "phases": self.phases, "total_cycles_median": self.total_median,
                "total_cycles_p90": self.total_p90, "span_ns": self.span_ns, "resident_blocks_per_sm": self.resident,
                "sm_ghz": self.ghz, "truncated_blocks": self.truncated}


def summarize(blocks: list[BlockProfile]) -> Summary:
    """Median/p90 per phase over ``blocks`` (a phase no block entered is left out)."""
    if not blocks:
        raise ValueError("blocks: no block made a mark (was the profiling build launched?)")
    cyc = np.stack([b.cycles for b in blocks])       # [blocks, phases]
    ent = np.stack([b.entries for b in blocks])
    tot = np.array([b.total for b in blocks], np.float64)
    all_cycles = float(cyc.sum())
    s = Summary(len(blocks), total_median=float(np.median(tot)), total_p90=float(np.percentile(tot, 90)),
                truncated=sum(b.truncated for b in blocks))
    for i, name in enumerate(PHASES):
        if name == "end" or not ent[:, i].any():
            continue
        s.phases[name] = {"median": float(np.median(cyc[:, i])), "p90": float(np.percentile(cyc[:, i], 90)),
                          "share": float(cyc[:, i].sum()) / all_cycles if all_cycles else 0.0,
                          "entries": float(np.median(ent[:, i]))}
    starts = np.array([b.start_ns for b in blocks], np.int64)
    ends = np.array([b.end_ns for b in blocks], np.int64)
    if (ends > starts).all():
        s.span_ns = int(ends.max() - starts.min())
        sms = np.array([b.sm for b in blocks])
        busy = []
        for sm in np.unique(sms):  # resident blocks on average = block-ns / the SM's own busy span
            m = sms == sm
            busy.append(float((ends[m] - starts[m]).sum()) / max(1, int(ends[m].max() - starts[m].min())))
        s.resident = float(np.mean(busy))
        s.ghz = float(np.median(tot / (ends - starts)))
    return s


def synthetic_record(sequence: list[int], blocks: int, cost: dict[int, int], sms: int = 4,
                     ns_per_cycle: float = 0.5) -> np.ndarray:
    """A record as the profiling build writes it, for a phase ``sequence`` (the team emulation's,
    ``native.team_phases``) with ``cost[phase]`` cycles per entry: what the CPU tests decode, and
    the GPU kit's dry run (no GPU: no clocks)."""
    rec = np.zeros((blocks, SLOTS), np.uint64)
    kept = min(len(sequence), SLOTS - HEAD)
    ids = np.asarray(sequence[:kept], np.uint64)
    steps = np.array([cost.get(int(p), 0) for p in sequence[:kept]], np.int64)
    for b in range(blocks):
        t0 = (1 << 40) * (b + 1) + 17 * b  # any origin: only differences count
        clk = (t0 + np.concatenate([[0], np.cumsum(steps[:-1])])).astype(np.uint64) & np.uint64(CLOCK_MASK)
        rec[b, HEAD:HEAD + kept] = (ids << np.uint64(CLOCK_BITS)) | clk
        rec[b, 0] = (np.uint64(b % sms) << np.uint64(32)) | np.uint64(len(sequence))
        start = 1_000_000 + 10 * b
        rec[b, 1] = start
        rec[b, 2] = start + int(steps[:-1].sum() * ns_per_cycle)
    return rec


def team_phases(A, algo: str = "block") -> list[int]:
    """The phase marks member 0 of algorithm ``algo`` makes on CPU ``A: [n, n]`` (one matrix), barriers
    included, in order: the team emulation's record (``csrc/eig_host.cpp``), the sequence the
    profiling build stamps on a GPU for a finite, nonzero matrix."""
    from . import native  # the extension, loaded on first use

    native._require("host")
    if A.dim() != 2:
        raise ValueError(f"A: expected one matrix [n, n], got shape {list(A.shape)}")
    A3, out = native._flatten(A.unsqueeze(0))
    f = native._ext.team_eigvalsh_f32 if A.dtype.is_floating_point and A.element_size() == 4 \
        else native._ext.team_eigvalsh_f64
    return list(f(A3.data_ptr(), out.data_ptr(), 1, A3.shape[-1], *A3.stride(), out.stride(0),
                  algo=native._ext.ALGOS[algo], phases=True))


_kernels: dict[tuple, object] = {}  # (variant, target) -> the loaded profiling kernel, configured


def run_profiled(A3, algo: str | None = None):
    """The profiling build of ``algo`` (the selection table's choice when None) on CUDA
    ``A3: [B, n, n]`` float32/float64 -> ``(eigenvalues [B, n], record [grid, SLOTS] int64 on
    the device, plan)``. The matrix must fit in shared memory (the record takes the work
    pointer). Asynchronous on the current stream: synchronize before reading the record."""
    import torch  # numpy-only callers (decode, the tests) never need it here

    from . import cuda, nvrtc

    B, n = A3.shape[0], A3.shape[-1]
    index = cuda.device_index(A3.device)
    spec = cuda.DeviceSpec.of_device(index)
    target = nvrtc.choose_target(spec.cc)
    p = cuda.plan(B, n, str(A3.dtype).removeprefix("torch."), spec, algo)
    if not p.variant.smem:
        raise ValueError(f"A3: n = {n} {A3.dtype} does not fit in shared memory; the profiling build needs it there")
    driver = cuda._driver()
    key = (p.variant, target, index)
    kernel = _kernels.get(key)
    if kernel is None:
        image = nvrtc.compile_variant(p.variant, target, OPTIONS)
        _, kernels = cuda._load_image(driver, image, (nvrtc.ENTRY,), "the eigensolver's profiling build")
        kernel = kernels[nvrtc.ENTRY]
        dev = nvrtc.unpack(driver.cuDeviceGet(index), "cuDeviceGet")
        attr = driver.CUfunction_attribute
        nvrtc.unpack(driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, p.smem, kernel,
                                                 dev), "setting the profiling build's shared memory")
        nvrtc.unpack(driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100, kernel,
                                                 dev), "setting the profiling build's carveout")
        _kernels[key] = kernel
    out = torch.empty(B, n, dtype=A3.dtype, device=A3.device)
    record = torch.zeros(p.grid, SLOTS, dtype=torch.int64, device=A3.device)
    args = cuda.launch_args(A3.data_ptr(), out.data_ptr(), record.data_ptr(), B, tuple(A3.stride()), out.stride(0))
    cuda.launch_kernel(kernel, (p.grid, 1, 1), (p.variant.threads, 1, 1), p.smem, args, index)
    return out, record, p
