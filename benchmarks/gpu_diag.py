"""What the GPU runs left unexplained, measured in two short steps.

    python benchmarks/gpu_diag.py accuracy [--time-limit S] [--dry-run]
    python benchmarks/gpu_diag.py profile  [--time-limit S] [--dry-run]

``accuracy``: the Triton results that failed on a GPU but pass under the interpreter, each
swept over the launch settings, so that one GPU run says which setting is at fault. It ran as
command 1's ``diag-accuracy`` step of ``gpu_run.py`` until the race of 2026-11-27 explained its
failures; ``race_probe.py --kit`` took that place, and this sweep runs by hand:

* ``raw N=1024``: the uncentred Gram of one program's 1024 fp16/bf16 rows about means up to
  100 (the H100 run of 2026-11-27 found ``test_gpu_against_fp64``'s uncentred 16-bit cases
  outside 4× torch float32). ``benchmarks/tensor_core_sum_model.py`` predicts 7-17× torch with
  the sums accumulating in the matrix instructions (``acc`` 0) and 1-2× with the launcher's
  block tile (``acc`` 2, flushed every 128 rows).
* ``raw T=24``: ``[2, 24, 2, 128]``, where 4 pipeline stages over 2 row blocks raced on an H100
  (2026-11-26); the launcher now asks for 3 stages everywhere.
* ``split``: the centred hi + lo split on channels whose means lie near their spread
  (``test_means_near_the_spread``: 35-59× torch float32 with ``acc`` 0, 1.2-1.4× with 2).

Each case's first row is the launcher's own choice (what the library runs); the rows after it
ask for a setting found failing, so the same run shows the failure beside the fix.
A row is one setting (dtype, rows per block BT, warps, pipeline stages, ``acc``: where the
products are summed, see ``_gram_dot``) with the kernel's relative error of the second moment
against float64 (the largest of 3 fresh draws), torch float32's error on the same draws, their
ratio, and ``moving`` when two launches on the same input gave different bits (a race).

``profile``: where the time goes. ``cov-call``: one keys update ``[8, 8, 2048, 128]`` bf16, host
time per call (50 calls, no sync in between) against device time (one CUDA graph of the call,
replayed 50 times), for the partials launch alone (uncentred and centred) and for
``Covariance.update`` as the probe runs it. ``eig-call``: the same two times for
``fastspec.eigvalsh`` on 4096 × 128² fp32. Then torch.profiler's top operations (by device
time and by host time) of ``Probe.measure`` at the 1.5B shape, and of training steps with keys
streaming, with the plain forward and step timed beside them.

``--dry-run``: CPU, the Triton interpreter (fp16 only: its bf16 ``tl.dot`` is wrong), tiny
sizes and two settings per case, so that this file cannot rot where no GPU exists (CI runs it).
``--time-limit``: no new row starts after it; the rows not run are listed.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's fastspec, like the other tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# benchmarks/ is on the path when run as a script (and in tests/test_gpu_run.py's import)
from gpu_tools import Clock

REPEATS = 3  # fresh draws per accuracy row
CALLS = 50   # calls per host / device timing of the covariance update


def _device(dry: bool):
    import torch

    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("gpu_diag.py --dry-run: set TRITON_INTERPRET=1 before starting (the "
                             "Triton kernels run on CPU only under the interpreter)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_diag.py: no CUDA device (use --dry-run)")
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------------------------ accuracy
def second_moment_error(x, center: bool, **launch) -> tuple[float, float, bool]:
    """(kernel error, torch float32 error, moving) of the second moment of ``x: [B, T, S, D]``:
    ``‖M − M64‖ / ‖M64‖`` with M the raw Gram (``center`` False) or the scatter about the mean."""
    import torch

    from fastspec.covariance.reference import covariance_partials_reference
    from fastspec.covariance.triton_update import covariance_partials_triton

    def moment(p) -> torch.Tensor:
        G = p.G.double()
        if center:  # about the shift c, moved to the mean: shift-invariant
            s, n = p.s.double(), p.n.double().clamp_min(1)[:, None, None]
            G = G - s[:, :, None] * s[:, None, :] / n
        return G

    first = covariance_partials_triton(x, center=center, **launch)
    again = covariance_partials_triton(x, center=center, **launch)
    moving = not (torch.equal(first.G, again.G) and torch.equal(first.s, again.s))
    truth = moment(covariance_partials_reference(x.double(), None, 1, center))
    ref = moment(covariance_partials_reference(x, None, 1, center))

    def err(m: torch.Tensor) -> float:
        return ((m - truth).norm() / truth.norm()).item()

    return err(moment(first)), err(ref), moving


def accuracy_rows(dry: bool) -> list[tuple[str, dict, Callable]]:
    """(case, launch settings, input maker) in the order they run: the most telling first."""
    import torch
    import triton

    from fastspec.covariance.triton_update import launch_config, pipeline_stages

    D = 128
    dev = _device(dry)
    dtypes = [torch.float16] if dry else [torch.float16, torch.bfloat16]

    def raw_input(dtype, T):
        return lambda: torch.randn(2, T, 2, D, device=dev).to(dtype)

    def long_input(dtype, N):
        # one program's rows (the launcher keeps >= 16·D/2 rows per split), means up to 100
        return lambda: (torch.randn(1, N, 1, D, device=dev) * 2 + 100 * torch.rand(D, device=dev)).to(dtype)

    def split_input(dtype):
        return lambda: (torch.randn(1, 1024, 1, D, device=dev) * torch.linspace(0.05, 2, D, device=dev)
                        + torch.linspace(-4, 4, D, device=dev)).to(dtype)

    def config(N: int, S: int, BT: int | None = None, warps: int | None = None, stages: int | None = None):
        cfg = launch_config(N, S, D, dev, 2, None)
        BT = BT or cfg.BT
        rps = triton.cdiv(triton.cdiv(N, cfg.split), BT) * BT
        split = triton.cdiv(N, rps)
        stages = stages or pipeline_stages(cfg.num_stages, N, rps, split, BT)
        return cfg._replace(BT=BT, num_warps=warps or cfg.num_warps, num_stages=stages, rows_per_split=rps,
                            split=split)

    rows = []
    # (BT, warps, stages, acc); None: the launcher's own choice. The first row of each case is
    # the launcher's whole choice (what the library runs); the others ask for a setting the
    # H100 runs found failing (4 stages; sums accumulating in the matrix instructions, acc 0),
    # so the same run shows the failure beside the fix
    long_settings = [(None, None, None, None), (None, None, None, 0), (None, None, 4, None)]
    raw_settings = [(None, None, None, None), (None, None, 4, 0), (64, 8, 4, 0)]
    split_settings = [(None, None, None, None), (None, None, None, 0)]
    if dry:
        long_settings, raw_settings, split_settings = long_settings[:2], raw_settings[:1], split_settings[:1]

    def add(name, N, S, settings, make, dtype):
        for BT, warps, stages, acc in settings:
            cfg = config(N, S, BT, warps, stages)
            rows.append((name, {"config": cfg, "acc": acc, "dtype": dtype}, make))

    N = 64 if dry else 1024
    for dtype in dtypes:
        add(f"raw N={N}", N, 1, long_settings, long_input(dtype, N), dtype)
        add("raw T=24", 48, 2, raw_settings, raw_input(dtype, 24), dtype)
        add("split", 1024, 1, split_settings, split_input(dtype), dtype)
    return rows


def accuracy(dry: bool, limit: float | None) -> int:
    import torch

    clock = Clock(limit)
    rows = accuracy_rows(dry)
    print(f"{'case':<10} {'dtype':<6} {'BT':>3} {'warps':>5} {'stages':>6} {'acc':>3}  "
          f"{'kernel err':>10} {'torch err':>10} {'ratio':>8}  moving")
    not_run = 0
    from fastspec.covariance.triton_update import block_accumulation

    for name, s, make in rows:
        cfg, dtype = s["config"], s["dtype"]
        acc = block_accumulation(True) if s["acc"] is None else s["acc"]  # 16-bit input: tensor cores
        label = (f"{name:<10} {str(dtype).removeprefix('torch.'):<6} {cfg.BT:>3} {cfg.num_warps:>5} "
                 f"{cfg.num_stages:>6} {acc:>3}")
        if clock.left() < 0:
            not_run += 1
            continue
        try:
            errs = []
            for draw in range(REPEATS):
                torch.manual_seed(draw)
                errs.append(second_moment_error(make(), name == "split", config=cfg, acc=s["acc"]))
            k, t = max(e[0] for e in errs), max(e[1] for e in errs)
            moving = any(e[2] for e in errs)
            print(f"{label}  {k:>10.3g} {t:>10.3g} {k / max(t, 1e-30):>8.3g}  {'MOVING' if moving else 'no'}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a setting that fails to compile is a finding, not the end
            print(f"{label}  ERROR {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
    if not_run:
        print(f"not run (time limit): {not_run} settings")
    return 0


# ------------------------------------------------------------------------------------ profile
def host_and_device_us(fn: Callable[[], object], device) -> tuple[float, float | str]:
    """(host µs per call with no sync between calls, device µs per call from a CUDA graph of one
    call replayed; or why the graph could not be captured)."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) / CALLS * 1e6  # on CUDA the GPU idles behind a host-bound loop
    if not cuda:
        return host, "no CUDA graph on CPU"
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream, as torch's docs ask
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            graph.replay()
        end.record()
        end.synchronize()
        return host, start.elapsed_time(end) / CALLS * 1e3
    except Exception as e:  # noqa: BLE001 - reported in the row
        return host, f"no graph: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def cov_call(dry: bool) -> None:
    import torch

    import fastspec
    from fastspec.covariance.triton_update import covariance_partials_triton

    dev = _device(dry)
    B, H, T, D = (1, 2, 32, 16) if dry else (8, 8, 2048, 128)
    dtype = torch.float16 if dry else torch.bfloat16
    x = torch.randn(B, H, T, D, device=dev).to(dtype).transpose(1, 2)  # [B, T, H, D] view, as the probe reads
    cov = fastspec.Covariance((H, D), track_mean=False, device=dev)
    calls = {"partials, uncentred": lambda: covariance_partials_triton(x, center=False),
             "partials, centred": lambda: covariance_partials_triton(x, center=True),
             "Covariance.update (auto, sv)": lambda: cov.update(x)}
    print(f"cov-call: keys [{B}, {H}, {T}, {D}] {dtype}; µs per call")
    for name, fn in calls.items():
        print_call(name, fn, dev)


def print_call(name: str, fn: Callable[[], object], dev) -> None:
    """One ``cov-call`` / ``eig-call`` line: :func:`host_and_device_us` of ``fn``."""
    host, device = host_and_device_us(fn, dev)
    dev_text = f"{device:.1f}" if isinstance(device, float) else device
    print(f"  {name:<30} host {host:9.1f}   device {dev_text}", flush=True)


def eig_call(dry: bool) -> None:
    """``fastspec.eigvalsh`` on the headline batch: the bench's event-timed call was 0.4 ms
    longer than the race's kernel alone (2.91 vs 2.51 ms, H100 2026-11-27); host vs device."""
    import torch

    import fastspec

    dev = _device(dry)
    B, n = (8, 16) if dry else (4096, 128)
    a = torch.randn(B, n, n, device=dev)
    a = a @ a.mT / n
    print(f"eig-call: B{B}-n{n}-fp32; µs per call")
    print_call("eigvalsh (auto)", lambda: fastspec.eigvalsh(a), dev)


def _top(prof, device) -> str:
    keys = ["self_cpu_time_total"]
    if device.type == "cuda":
        avg = prof.key_averages()
        keys.insert(0, "self_device_time_total" if hasattr(avg[0], "self_device_time_total")
                    else "self_cuda_time_total")
    out = []
    for key in keys:
        out.append(f"-- top by {key}")
        out.append(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=55))
    return "\n".join(out)


def _timed(fn: Callable[[], object], device) -> float:
    """Median ms of ``fn`` over 3 calls after one warm-up (the benchmarks' timer)."""
    from fastspec.bench.timing import measure

    return measure(fn, device=device, warmup=1, repeats=3).median * 1e3


def _llama(dry: bool, train: bool):
    """(device, size id, model, token ids): the probe suite's model (1.5B shape on GPU, tiny in a
    dry run), in train or eval mode."""
    from fastspec.bench import models
    from fastspec.bench.suites.probe import PROBE_SHAPES, PROBE_TOKENS

    dev = _device(dry)
    tier = "quick" if dry else "gpu"
    shape, toks = PROBE_SHAPES[tier], PROBE_TOKENS[tier]
    model = models.build_llama(tier, dev, shape=shape).train(train)
    return dev, models.size_id(tier, shape, toks), model, models.tokens(toks, shape["vocab_size"], dev)


def _profiled(fn: Callable[[], object], device) -> str:
    """torch.profiler's top operations of one ``fn()`` call (device work included)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return _top(prof, device)


def profile_measure(dry: bool) -> None:
    import torch

    import fastspec

    dev, size, model, ids = _llama(dry, train=False)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    probe = fastspec.Probe(model, keys=True, ffn=False)

    def forward():
        with torch.no_grad():
            model(**batch)

    def measure():
        probe.measure(batch, step=0)

    t_fwd, t_measure = _timed(forward, dev), _timed(measure, dev)
    print(f"measure: {size}: forward {t_fwd:.1f} ms, measure {t_measure:.1f} ms "
          f"(+{t_measure - t_fwd:.1f} ms, {100 * (t_measure / t_fwd - 1):+.1f}%)", flush=True)
    print(_profiled(measure, dev), flush=True)
    probe.close()


def profile_step(dry: bool) -> None:
    import torch

    import fastspec

    dev, size, model, ids = _llama(dry, train=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    probe = fastspec.Probe(model, keys=True, ffn=False, emit_every=100)
    step = [0]

    def train():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def probed():
        train()
        probe.step(step[0])
        step[0] += 1

    t_plain = _timed(train, dev)
    with probe.streaming():  # once around the loop, as in training
        t_probed = _timed(probed, dev)
        print(f"train step: {size}: plain {t_plain:.1f} ms, keys streaming "
              f"{t_probed:.1f} ms ({100 * (t_probed / t_plain - 1):+.1f}%)", flush=True)
        table = _profiled(probed, dev)
    print(table, flush=True)
    probe.close()


def profile_all(dry: bool, limit: float | None) -> int:
    clock = Clock(limit)
    parts = {"cov-call": cov_call, "eig-call": eig_call, "measure": profile_measure, "train-step": profile_step}
    for name, part in parts.items():
        if clock.left() < 0:
            print(f"{name}: not run (time limit)")
            continue
        try:
            part(dry)
        except Exception as e:  # noqa: BLE001 - one part failing keeps the others
            print(f"{name}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        gc.collect()  # a probe and its model hold each other (hooks): free both before the next part
        if not dry:
            import torch

            torch.cuda.empty_cache()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_diag.py", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("accuracy", "profile"))
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="no new row after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, the Triton interpreter, tiny sizes")
    args = p.parse_args(argv)
    return (accuracy if args.what == "accuracy" else profile_all)(args.dry_run, args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
