"""``fastspec info``: versions and solver availability, as one would paste into a bug report.

What it reports comes from the library: :func:`fastspec.sysinfo.environment`,
:func:`fastspec.solvers` and :func:`fastspec.eig.cuda.build_info`.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    import fastspec

    from ..eig.cuda import build_info
    from ..sysinfo import environment

    # "eigvalsh_backends": the key scripts already read, kept through the solver= rename
    info = {"environment": environment(), "eigvalsh_backends": fastspec.solvers(), "eigvalsh_kernel": build_info()}
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
    print(f"{'cache':>10}: {k['cache']} ({'writable' if k['cache_writable'] else 'NOT writable'}, "
          f"{k['cached_kernels']} kernels; FASTSPEC_CACHE moves it)")
    return 0
