"""``fastspec info``: versions and solver availability, as one would paste into a bug report.

What it reports comes from the library: :func:`fastspec.sysinfo.environment`,
:func:`fastspec.solvers`, :func:`fastspec.eig.cuda.build_info` and
:func:`fastspec.eig.cuda.selection_info` (which algorithm of the kernel runs where, and why),
:func:`fastspec.covariance.routes.info` (which route an exact covariance update takes, and why),
:func:`fastspec.covariance.triton_configs.info` (which launch settings the float32 Triton
covariance kernels use, and why),
:func:`fastspec.eig.mathdx.info` (whether NVIDIA cuSolverDx's heev can be built here, with which
versions, or why not: the ``fastspec[mathdx]`` extra).
"""
from __future__ import annotations

import argparse
import json
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--check", action="store_true",
                   help="run the first-use self-check of every kernel configuration on the visible GPU and print "
                        "a table (exit status 1 if one fails)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="with --check: start no new check after S seconds")


def run(args: argparse.Namespace) -> int:
    if args.check:
        return run_checks(args)
    import fastspec

    from ..covariance import routes
    from ..eig.cuda import build_info, selection_info
    from ..sysinfo import environment

    # "eigvalsh_backends": the key scripts already read, kept through the solver= rename
    info = {"environment": environment(), "eigvalsh_backends": fastspec.solvers(), "eigvalsh_kernel": build_info(),
            "eigvalsh_variants": selection_info(), "eigvalsh_cusolverdx": cusolverdx_info(),
            "covariance_routes": routes.info(), "covariance_triton_configs": triton_configs_info()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info["environment"].items():
        print(f"{k:>10}: {v}")
    for name, b in info["eigvalsh_backends"].items():
        print(f"{'eigvalsh':>10}: {name:<6} {'yes' if b['available'] else 'no ':<4} {b['reason']}")
    k = info["eigvalsh_kernel"]
    if k["compiler"] is None:
        print(f"{'kernel':>10}: cannot be compiled here: {k['reason']}")
    else:
        archs = k["archs"]
        where = (f"for {k['target']} (this GPU)" if k["target"] else
                 k.get("reason") or f"no GPU here (it targets sm_{archs[0]} to sm_{archs[-1]})")
        print(f"{'kernel':>10}: compiled at first use by {k['compiler']} ({k['binding']}): {where}")
    print(f"{'cache':>10}: {k['cache']} ({cache_state(k)}; FASTSPEC_CACHE moves it)")
    if k["cache_refused"]:
        print(f"{'':>10}  NOT USED (kernels compile into memory): {k['cache_refused']}")
    sel = info["eigvalsh_variants"]
    where = f"this GPU (sm_{sel['arch']})" if sel["gpu"] else f"sm_{sel['arch']} (no GPU here)"
    print(f"{'variant':>10}: the kernel's algorithm per problem on {where} "
          f"({sel.get('rows', '?')} measured rows in {sel['table']}; {variants_hint(sel['override'])})")
    if "error" in sel:
        print(f"{'':>10}  error: {sel['error']}")
    for c in sel["choices"]:
        print(f"{'':>10}  {c['dtype']} n {c['n']:<3} x{c['batch']:<5} {c['algo']:<6} {c['why']}")
    print(f"{'cusolverdx':>10}: {cusolverdx_text(info['eigvalsh_cusolverdx'])}")
    r = info["covariance_routes"]
    override = f"FASTSPEC_COV_VARIANT={r['override']}" if r["override"] else "FASTSPEC_COV_VARIANT forces one"
    print(f"{'cov route':>10}: exact (float64) raw-sum update on {r['device']} "
          f"({r.get('rows', '?')} measured rows in {r['table']}; {override})")
    for name, status in r["routes"].items():
        print(f"{'':>10}  {name:<10} {status}")
    if "error" in r:
        print(f"{'':>10}  error: {r['error']}")
    else:
        print(f"{'':>10}  {r['shape']}: {r['choice']} ({r['why']})")
    for line in triton_configs_text(info["covariance_triton_configs"]):
        print(line)
    return 0


def triton_configs_info() -> dict:
    """:func:`fastspec.covariance.triton_configs.info` with the table's row count and the override,
    or ``{"error": ...}`` when asking fails (a table that does not load, say): a line of the
    report, not a traceback instead of it."""
    try:
        from ..covariance import triton_configs

        out = triton_configs.info()
        out["table"] = triton_configs.TABLE.name
        out["override"] = os.environ.get(triton_configs.ENV, "").strip() or None
        try:
            out["rows"] = len(triton_configs.load_table())
        except Exception as e:  # noqa: BLE001 - info() reports each choice's own error; the count says why
            out["rows"] = None
            out["error"] = f"{type(e).__name__}: {e}"
        return out
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()
        return {"error": f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": "), "choices": []}


def triton_configs_text(t: dict) -> list[str]:
    """The ``triton cfg`` section: the device and table, then one line per kernel, dtype and
    convention (the candidate and why), or the error."""
    if "device" not in t:
        return [f"{'triton cfg':>10}: cannot tell: {t.get('error')}"]
    override = f"FASTSPEC_COV_TRITON_CONFIG={t['override']}" if t.get("override") else \
        "FASTSPEC_COV_TRITON_CONFIG forces one"
    rows = t.get("rows")
    out = [(f"{'triton cfg':>10}: float32 Triton covariance kernels' launch settings on {t['device']} "
            f"({'?' if rows is None else rows} measured rows in {t.get('table', '?')}; {override})")]
    if t.get("error"):
        out.append(f"{'':>10}  error: {t['error']}")
    for c in t.get("choices", []):
        conv = "centred" if c["center"] else "raw"
        out.append(f"{'':>10}  {c['kernel']:<4} {c['dtype']:<8} {conv:<7} {c['config']} ({c['why']})")
    return out


def cusolverdx_info() -> dict[str, object]:
    """:func:`fastspec.eig.mathdx.info`, or ``{"available": False, "reason": ...}`` when asking
    fails: a broken optional library is a line of the report, not a traceback instead of it."""
    try:
        from ..eig import mathdx  # here, not at import: `import fastspec` stays light

        return mathdx.info()
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()
        return {"available": False, "reason": f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": "),
                "libmathdx": None}


def cusolverdx_text(d: dict) -> str:
    """One line: cuSolverDx's heev available, with the versions it is built with, or why not."""
    if not d.get("available"):
        return f"cuSolverDx heev cannot be built here: {d.get('reason')}"
    return (f"cuSolverDx heev available (cuSolverDx {d.get('cusolverdx')}, {d.get('libmathdx')}, nvJitLink "
            f"{d.get('nvjitlink')}): raced beside the kernel's algorithms, the eigvalsh anchor cusolverdx::heev, "
            "FASTSPEC_EIG_VARIANT=cusolverdx forces it")


def variants_hint(override: str | None) -> str:
    return f"FASTSPEC_EIG_VARIANT={override}" if override else "FASTSPEC_EIG_VARIANT forces one"


def cache_state(k: dict) -> str:
    """The kernel cache's owner and mode (a private cache: yours and ``0700``), or that it is not
    made yet, whether it can be written, and how many kernels it holds."""
    where = (f"owner {k['cache_owner']}, mode {k['cache_mode']}" if k["cache_mode"] else
             "not created yet" + ("" if k["cache_refused"] else ": made 0700 at the first compile"))
    return f"{where}, {'writable' if k['cache_writable'] else 'NOT writable'}, {k['cached_kernels']} kernels"


def run_checks(args: argparse.Namespace) -> int:
    """``fastspec info --check``: every configuration's self-check on the current GPU, as a table
    (fastspec/selfcheck.py); without a GPU, one line saying so. Exit status 1 when one failed."""
    import torch

    from .. import preflight, selfcheck

    if not torch.cuda.is_available():
        msg = ("no CUDA device visible to torch: the self-checks run fastspec's GPU kernels (exact covariance "
               "routes, float32 Triton updates, the CUDA eigensolver) on one, and there is none here to run; "
               "on the CPU the torch reference paths serve, which need no check")
        print(json.dumps({"device": None, "checks": [], "note": msg}, indent=2) if args.json else msg)
        return 0
    if not selfcheck.enabled():
        print(f"self-checks are off (${selfcheck.ENV}={os.environ.get(selfcheck.ENV)}): unset it to run them")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    rows = preflight.check_everything(device, args.time_limit)
    failed = [r for r in rows if r["verdict"] == "FAILED"]
    if args.json:
        print(json.dumps({"device": selfcheck.describe_device(device), "checks": rows}, indent=2))
        return 1 if failed else 0
    print(f"self-checks on {selfcheck.describe_device(device)}:")
    width = max(len(r["kernel"]) for r in rows)
    for r in rows:
        note = f"  {r['error']}" if r["error"] else ""
        print(f"  {r['kernel']:<{width}}  {r['config']:<24} {r['verdict']:<15} {r['seconds']:7.3f} s{note}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("passed", "FAILED", "cannot run here", "not run")}
    print("  " + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
    return 1 if failed else 0
