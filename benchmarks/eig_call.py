"""Where one ``fastspec.eigvalsh`` call's time goes: host, launch, device.

    python benchmarks/eig_call.py --json OUT.json [--time-limit S] [--dry-run]

On an H200 the bench's event-timed call of 4096 x 128² float32 took 3.01 ms, the same call
CUDA-graphed 2.46 ms, and a loop of calls 164.6 µs of host time each. This script
takes one call apart, for the kernel's target shape (4096 x 128², float32) and the probe's keys
solve (256 x 128², float64):

* ``host``: host µs per call, a loop of 200 calls with no sync between (``time.perf_counter``),
  for the public call and for each layer under it: ``public`` (``fastspec.eigvalsh(A)``),
  ``public_cuda`` (``solver="cuda"``), ``fast`` (the dispatch's CUDA fast path past its guard),
  ``op`` (``torch.ops.fastspec.eigvalsh``), ``native`` (``native.cuda_eigvalsh``), ``launch``
  (``cuda.launch`` into a preallocated output) and ``raw`` (``cuLaunchKernel`` with prebuilt
  parameters: the binding's own cost);
* ``events``: a synchronized single call between CUDA events (synchronize, record, call,
  record), what the bench reports; the median of 20;
* ``device``: the call's device work with the host's queueing hidden behind a spin kernel
  (``fastspec.bench.timing.device_time_once``); the median of 20;
* ``graphed``: one call captured in a CUDA graph, replayed 20 times between events;
* ``kernel``: 20 raw launches between events: the kernel alone.

It prints the differences (events − graphed, events − device, device − kernel, graphed − kernel)
and a one-line verdict of where the gap is, and writes them as JSON (schema
``fastspec-eig-call-1``, with :func:`fastspec.sysinfo.environment`).

``--dry-run`` (CPU, no GPU needed): the host cost alone, through a stand-in driver whose
cuLaunchKernel does nothing (:class:`StubDriver`; NVRTC is not run either), on small batches of
the same n and dtypes. A CPU tensor cannot take the public call's CUDA path, so the layers are
measured one by one: ``fast``, ``native`` and ``launch`` are the CUDA path's own code; ``op`` and
``public`` run ``torch.ops.fastspec.eigvalsh`` and ``fastspec.eigvalsh(A, solver="host")`` with
the host twin's launcher replaced by the CUDA one (their dispatch, then the CUDA path).
The stand-in's current device, stream and device switch cost less than torch's real ones.
``--time-limit``: no measurement starts after S seconds; those not run are listed.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's fastspec, like the other tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = "fastspec-eig-call-1"
CALLS = 200     # calls per host loop
REPEATS = 20    # timed calls, graph replays, raw launches
SHAPES = (("kernel", 4096, 128, "float32"), ("probe-keys", 256, 128, "float64"))
"""(name, batch, n, dtype): the kernel's target shape and the probe's keys solve."""
DRY_BATCH = {"kernel": 64, "probe-keys": 16}
"""--dry-run's batches (the host cost does not depend on them; the CPU's memory does)."""
HOST_LEVELS = ("public", "public_cuda", "fast", "op", "native", "launch", "raw")
DRY_LEVELS = ("public", "fast", "op", "native", "launch")


# ------------------------------------------------------------------------------ --dry-run's stand-in
class StubDriver(types.SimpleNamespace):
    """``cuda.bindings.driver`` as far as fastspec/eig/cuda.py calls it: every call succeeds,
    cuLaunchKernel does nothing but count (``launches``)."""

    def __init__(self) -> None:
        super().__init__(launches=0)
        self.CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
                                                          CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT=9)

    def cuInit(self, flags):
        return (0,)

    def cuDriverGetVersion(self):
        return (0, 13000)

    def cuDeviceGet(self, index):
        return (0, index)

    def cuKernelSetAttribute(self, *args):
        return (0,)

    def cuCtxGetCurrent(self):
        return (0, 7)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (0, 7)

    def cuDevicePrimaryCtxRelease(self, dev):
        return (0,)

    def cuLaunchKernel(self, *args):
        self.launches += 1
        return (0,)


class _Patches:
    """setattr that remembers, undone in reverse order (an attribute that was not there is removed)."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        self.undo.append((obj, name, getattr(obj, name, _Patches)))
        setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, old in reversed(self.undo):
            if old is _Patches:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.undo.clear()


@contextlib.contextmanager
def stub_gpu():
    """fastspec/eig/cuda.py on CPU tensors against :class:`StubDriver`: an H100's plan (sm_90), device
    0 current, stream 0, kernels "loaded" without NVRTC, nothing cached from before; and the host
    twin's launcher replaced by the CUDA one (the op and the public call then take the CUDA
    path's code). Everything is put back on exit."""
    import torch

    from fastspec.eig import cuda, native, nvrtc

    drv = StubDriver()
    p = _Patches()
    try:
        p.set(cuda, "_driver", lambda: drv)
        from fastspec import selfcheck

        p.set(selfcheck, "enabled", lambda: False)  # the stub's kernels compute nothing to check
        p.set(cuda, "_binding", [(True, "stub driver")])
        p.set(cuda, "_device_setup", lambda index: (cuda.DeviceSpec.for_arch(90), nvrtc.Target(90)))
        p.set(cuda, "_load", lambda driver, variant, target: cuda._Loaded(("stub", variant.algo), "lib", set()))
        for name in ("_loaded", "_failed", "_plans"):
            p.set(cuda, name, {})
        p.set(cuda, "_driver_ready", [])
        p.set(cuda, "_thread", type(cuda._thread)())
        p.set(cuda, "_current_device", lambda: 0)
        p.set(cuda, "_raw_stream", lambda index: 0)
        p.set(torch.cuda, "current_device", lambda: 0)
        p.set(torch.cuda, "device", lambda index: contextlib.nullcontext())
        p.set(torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=0))
        p.set(native, "host_eigvalsh", native.cuda_eigvalsh)
        yield drv
    finally:
        p.restore()


# ------------------------------------------------------------------------------------ measurements
class Deadline:
    """``--time-limit``: whether a new measurement may start."""

    def __init__(self, limit: float | None) -> None:
        self.end = None if limit is None else time.monotonic() + limit

    def ok(self) -> bool:
        return self.end is None or time.monotonic() < self.end


def host_us(fn: Callable[[], object], sync: Callable[[], None], loops: int) -> float:
    """Host µs per call: ``loops`` loops of :data:`CALLS` calls with no sync between calls (the
    median over loops; a sync between loops, outside the timing, keeps the GPU's queue short)."""
    for _ in range(3):
        fn()
    sync()
    per = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t0) / CALLS * 1e6)
        sync()
    return statistics.median(per)


def _levels(A, out, dry: bool) -> dict[str, Callable[[], object]]:
    """The callables of each layer of one call (the module docstring's ``host`` list)."""
    import torch

    import fastspec
    from fastspec.eig import cuda, dispatch, native

    levels: dict[str, Callable[[], object]] = {
        "public": (lambda: fastspec.eigvalsh(A, solver="host")) if dry else (lambda: fastspec.eigvalsh(A)),
        "public_cuda": lambda: fastspec.eigvalsh(A, solver="cuda"),
        "op": lambda: torch.ops.fastspec.eigvalsh(A),
        "native": lambda: native.cuda_eigvalsh(A),
        "launch": lambda: cuda.launch(A, out),
    }
    if hasattr(dispatch, "_fast_cuda"):  # the dispatch's CUDA fast path (not in every version measured)
        levels["fast"] = lambda: dispatch._fast_cuda(A, "auto")
    if not dry:
        levels["raw"] = _raw_launch(A, out)
    return {k: levels[k] for k in (DRY_LEVELS if dry else HOST_LEVELS) if k in levels}


def _raw_launch(A, out) -> Callable[[], object]:
    """One cuLaunchKernel of the problem's kernel with parameters built once (the kernel alone)."""
    import torch

    from fastspec.eig import cuda

    B, n = out.shape
    entry, p = cuda.prepare(n, A.dtype, A.device, batch=B)
    work = torch.empty(p.workspace, dtype=A.dtype, device=A.device) if p.workspace else None
    args = cuda.launch_args(A.data_ptr(), out.data_ptr(), 0 if work is None else work.data_ptr(), B, A.stride(),
                            out.stride(0))
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    driver, stream = cuda._driver(), torch.cuda.current_stream(A.device).cuda_stream
    kernel, grid, threads, smem, address = entry.kernel, p.grid, p.variant.threads, p.smem, ctypes.addressof(params)

    def raw():
        keep = (args, params, work)  # alive as long as the callable
        driver.cuLaunchKernel(kernel, grid, 1, 1, threads, 1, 1, smem, stream, address, 0)
        return keep

    return raw


def graphed_us(fn: Callable[[], object]) -> float:
    """Device µs per call of ``fn`` captured once in a CUDA graph, replayed :data:`REPEATS` times."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up on the capture stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return _between_events(graph.replay)


def _between_events(fn: Callable[[], object]) -> float:
    """µs per call of :data:`REPEATS` back-to-back calls of ``fn`` between two events."""
    import torch

    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / REPEATS * 1e3


def measure_shape(name: str, batch: int, n: int, dtype: str, dry: bool, deadline: Deadline,
                  skipped: list[str]) -> dict:
    """Every number of one shape (``None`` where not measured: a dry run, or past the deadline)."""
    import torch

    import fastspec
    from fastspec.bench import timing
    from fastspec.eig import cuda

    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    A = torch.randn(batch, n, n, generator=g, dtype=dt)
    A = (A + A.mT).to(device)
    out = torch.empty(batch, n, dtype=dt, device=device)
    sync = (lambda: None) if dry else torch.cuda.synchronize
    row: dict = {"name": name, "batch": batch, "n": n, "dtype": dtype, "plan": None, "host_us": {},
                 "events_us": None, "device_us": None, "device_host_us": None, "graphed_us": None,
                 "kernel_us": None, "diff_us": {}, "verdict": ""}
    if not deadline.ok():
        skipped.append(f"{name}: everything")
        return row
    try:
        cuda.launch(A, out)  # the first call: compile (or the cache), load, plan; outside every timing
        sync()
        _, p = cuda.prepare(n, dt, 0 if dry else device, batch=batch)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot be had: said in the row
        row["errors"] = {"first call": f"{type(exc).__name__}: {exc}"}
        row["verdict"] = "not measured: the first call failed"
        return row
    row["plan"] = {"algo": p.variant.algo, "grid": p.grid, "threads": p.variant.threads, "smem": p.smem,
                   "workspace": p.workspace, "why": p.why}
    levels = _levels(A, out, dry)

    def host_step(level: str) -> Callable[[], float]:
        return lambda: host_us(levels[level], sync, loops=7 if dry else (2 if level == "public" else 1))

    def call():
        return fastspec.eigvalsh(A)

    # the verdict's numbers first (the public call's host time, then the device's), the layers
    # under the public call after them: a time limit cuts the layers first
    steps: list[tuple[str, Callable[[], float]]] = [("host public", host_step("public"))]
    if not dry:
        steps += [("events_us", lambda: 1e6 * statistics.median(timing.time_once(call, device) for _ in range(REPEATS))),
                  ("device_us", lambda: _device_us(call, device, row)),
                  ("graphed_us", lambda: graphed_us(call)),
                  ("kernel_us", lambda: _kernel_us(A, out))]
    steps += [(f"host {level}", host_step(level)) for level in levels if level != "public"]
    for key, step in steps:
        if not deadline.ok():
            skipped.append(f"{name}: {key}")
            continue
        try:
            value = step()
        except Exception as exc:  # noqa: BLE001 - said in the row, the other numbers still count
            value = None
            row.setdefault("errors", {})[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if key.startswith("host "):
            row["host_us"][key.removeprefix("host ")] = value
        else:
            row[key] = value
    if dry:
        row["verdict"] = ("dry run: host cost only (stand-in driver, CPU tensors; public = eigvalsh(solver='host') "
                          "through the CUDA path's code)")
        return row
    row["diff_us"] = differences(row)
    row["verdict"] = verdict(row)
    return row


def _device_us(call: Callable[[], object], device, row: dict) -> float:
    """The call's device µs with the host hidden (median of :data:`REPEATS`); the host's queueing
    µs of those calls goes into ``row["device_host_us"]``."""
    from fastspec.bench import timing

    spin = timing.Spin()
    for _ in range(2):  # the spin learns the call's host time
        timing.device_time_once(call, device, spin)
    got = [timing.device_time_once(call, device, spin) for _ in range(REPEATS)]
    hosts = [h for _, h in got if h is not None]
    row["device_host_us"] = 1e6 * statistics.median(hosts) if hosts else None
    if len(hosts) < len(got):
        row.setdefault("errors", {})["device_us"] = f"{len(got) - len(hosts)} of {len(got)} calls not covered by the spin"
    return 1e6 * statistics.median(t for t, _ in got)


def _kernel_us(A, out) -> float:
    raw = _raw_launch(A, out)
    raw()
    return _between_events(raw)


def differences(row: dict) -> dict[str, float | None]:
    """events − graphed, events − device, device − kernel, graphed − kernel (µs; None where a term
    is missing)."""
    def minus(a: str, b: str) -> float | None:
        x, y = row.get(a), row.get(b)
        return None if x is None or y is None else x - y

    return {"events_minus_graphed": minus("events_us", "graphed_us"),
            "events_minus_device": minus("events_us", "device_us"),
            "device_minus_kernel": minus("device_us", "kernel_us"),
            "graphed_minus_kernel": minus("graphed_us", "kernel_us")}


def verdict(row: dict) -> str:
    """One line: where the gap between the bench's number (events) and the kernel's is."""
    host = row["host_us"].get("public")
    ev, dev, kern = row.get("events_us"), row.get("device_us"), row.get("kernel_us")
    if ev is None or dev is None or kern is None:
        return "incomplete: " + ", ".join(k for k in ("events_us", "device_us", "kernel_us") if row.get(k) is None) \
               + " not measured"
    noise = max(20.0, 0.02 * kern)
    extra_device, waiting = dev - kern, ev - dev
    if extra_device > noise:
        return (f"hidden device work: the call's device time {dev:.0f} µs exceeds the kernel's {kern:.0f} µs by "
                f"{extra_device:.0f} µs (another kernel, a copy or a wait inside the call)")
    if waiting > noise:
        said = f"host {host:.0f} µs per call" if host is not None else "host time not measured"
        rest = waiting - (host or 0.0)
        tail = (f"; {rest:.0f} µs more than the call's host time: the idle GPU's start (launch latency, clocks)"
                if rest > noise else "")
        return (f"the host: a synchronized call waits {waiting:.0f} µs beyond its device work ({said}), the GPU "
                f"idle while the call is queued{tail}")
    return f"no gap: the synchronized call ({ev:.0f} µs) costs its device work ({dev:.0f} µs, kernel {kern:.0f} µs)"


# ------------------------------------------------------------------------------------------- main
def run(dry: bool, limit: float | None) -> dict:
    """Every shape's numbers, the run's JSON document."""
    import torch

    import fastspec.sysinfo

    if not dry and not torch.cuda.is_available():
        raise SystemExit("eig_call.py: no CUDA device (use --dry-run)")
    deadline = Deadline(limit)
    skipped: list[str] = []
    doc = {"schema": SCHEMA, "dry_run": dry, "environment": fastspec.sysinfo.environment(), "calls": CALLS,
           "repeats": REPEATS, "time_limit_s": limit, "shapes": [], "skipped": skipped,
           "levels": list(DRY_LEVELS if dry else HOST_LEVELS)}
    with stub_gpu() if dry else contextlib.nullcontext():
        for name, batch, n, dtype in SHAPES:
            doc["shapes"].append(measure_shape(name, DRY_BATCH[name] if dry else batch, n, dtype, dry, deadline,
                                               skipped))
    return doc


def report(doc: dict) -> None:
    """The numbers as text, one block per shape."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"eig_call ({'dry run: host only, stand-in driver' if doc['dry_run'] else doc['environment']['device']}); "
          f"µs per call")
    for r in doc["shapes"]:
        print(f"{r['name']}: {r['batch']} x {r['n']}^2 {r['dtype']}"
              + (f", {r['plan']['algo']} grid {r['plan']['grid']} x {r['plan']['threads']}" if r["plan"] else ""))
        print("  host   " + "  ".join(f"{k} {f(v)}" for k, v in r["host_us"].items()))
        if not doc["dry_run"]:
            print(f"  events {f(r['events_us'])}  device {f(r['device_us'])} (host {f(r['device_host_us'])})  "
                  f"graphed {f(r['graphed_us'])}  kernel {f(r['kernel_us'])}")
            print("  diff   " + "  ".join(f"{k} {f(v)}" for k, v in r["diff_us"].items()))
        print(f"  verdict: {r['verdict']}")
    if doc["skipped"]:
        print("not run (time limit): " + "; ".join(doc["skipped"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, metavar="OUT.json", help="where the numbers go")
    ap.add_argument("--time-limit", type=float, metavar="S", help="no measurement starts after S seconds")
    ap.add_argument("--dry-run", action="store_true", help="CPU, stand-in driver: the host cost only")
    args = ap.parse_args(argv)
    if args.time_limit is not None and args.time_limit < 0:
        ap.error(f"--time-limit: expected seconds >= 0, got {args.time_limit:g}")
    doc = run(args.dry_run, args.time_limit)
    report(doc)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
