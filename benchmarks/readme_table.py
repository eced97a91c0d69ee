"""The README's benchmark table, generated from ``benchmarks/results/*.json``: never typed.

A developer tool, not part of the installed package. Every number in the table comes from a
result file in ``benchmarks/results/`` and each table names the device and file that produced
it; the rows are rendered with the cells ``fastspec bench --wide`` prints
(:func:`fastspec.bench.table.bench_cells`).

    python benchmarks/readme_table.py                  # rewrite the block between the README markers
    python benchmarks/readme_table.py --check          # exit 1 if the README is out of date
    python benchmarks/readme_table.py --readme PATH    # another README (results: PATH's folder/benchmarks/results)

The README is rewritten only by this command, never as a side effect of a benchmark run.
Without ``--readme`` it is ``README.md`` of the checkout this file is in, whatever the current
directory. ``tests/test_bench_table.py`` checks the committed README against the committed
results (``sys.path.insert(0, "<repo>/benchmarks"); import readme_table``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from fastspec.bench.case import FLOOR_EPS
from fastspec.bench.table import BENCH_COLUMNS, bench_cells, describe_environment

BEGIN, END = "<!-- bench-table -->", "<!-- /bench-table -->"
ROOT = Path(__file__).resolve().parents[1]
PROG = "python benchmarks/readme_table.py"


def render_markdown(columns: tuple[str, ...], cells: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r.get(c, "").replace("|", "\\|") for c in columns) + " |" for r in cells]
    return "\n".join(lines)


def load_results(results_dir: Path, kind: str = "bench") -> list[tuple[Path, dict]]:
    """``fastspec bench --json`` (or ``compare``) documents in ``results_dir``, sorted by name."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("kind") == kind:
            out.append((path, doc))
    return out


def compare_summary(doc: dict, name: str) -> str:
    """One line for a ``fastspec compare`` document: how many rows hold the bound, the worst."""
    rows = [r for r in doc["results"] if "skipped" not in r]  # cut by a time cap: not run
    ok = sum(bool(r.get("within_2x_torch")) for r in rows)
    rated = [r for r in rows if r.get("ratio") is not None]
    worst = max(rated, key=lambda r: r["ratio"]) if rated else None
    families = sorted({r["family"] for r in rows})
    line = (f"Accuracy (`fastspec compare`, {describe_environment(doc['environment'])}): {ok}/{len(rows)} "
            f"(family, n, solver) within 2× torch.linalg fp32 + {FLOOR_EPS}·eps vs fp64, over {len(families)} "
            f"matrix families ({', '.join(families)})")
    if len(rows) < len(doc["results"]):
        line += f"; {len(doc['results']) - len(rows)} not run (time cap)"
    if worst is not None:
        line += (f"; worst ratio to torch {worst['ratio']:.3g} ({worst['family']}, n={worst['n']}, "
                 f"{worst['variant']})")
    return line + f"; from `{name}`.\n"


def _gpu_first(docs: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """GPU runs before CPU runs (the CPU ones time the fallback paths), each group by name."""
    return sorted(docs, key=lambda item: (item[1]["environment"]["device"] == "cpu", item[0].name))


LEASE_S = 30 * 60  # a GPU machine is held at most 30 minutes: one run's files lie within it


def _when(doc: dict) -> datetime:
    """A document's ``date`` (``2026-11-27T18:00:24Z``, or a bare day: its midnight), UTC."""
    return datetime.fromisoformat(doc["date"][:19]).replace(tzinfo=timezone.utc)


def newest_gpu_runs(docs: list[tuple[Path, dict]]) -> tuple[list[tuple[Path, dict]], list[tuple[Path, dict]]]:
    """``(shown, earlier)``: of the GPU documents, those of each device's newest run (its
    commands' files: dated within one lease, :data:`LEASE_S`, of that device's newest file; two
    runs can share a day), the others earlier; every CPU document is shown (each is a benchmark
    of its own)."""
    def device(doc: dict) -> str:
        return doc["environment"]["device"]

    newest: dict[str, datetime] = {}
    for _, doc in docs:
        if device(doc) != "cpu":
            newest[device(doc)] = max(newest.get(device(doc), _when(doc)), _when(doc))
    shown, earlier = [], []
    for path, doc in docs:
        newer = device(doc) == "cpu" or (newest[device(doc)] - _when(doc)).total_seconds() <= LEASE_S
        (shown if newer else earlier).append((path, doc))
    return shown, earlier


def readme_block(results_dir: Path, relative_to: Path = Path(".")) -> str:
    """The markdown between the README markers: one table per result file, measured rows only,
    for each GPU its newest run (the earlier runs' files are named below the tables).

    File names are written relative to ``relative_to`` (the README's folder).
    """
    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, relative_to)).as_posix()

    parts = []
    bench, earlier = newest_gpu_runs(load_results(results_dir))
    compare, earlier_compare = newest_gpu_runs(load_results(results_dir, "compare"))
    for path, doc in _gpu_first(bench):
        name = rel(path)
        measured = [r for r in doc["results"] if "fastspec_s" in r]
        left_out = len(doc["results"]) - len(measured)
        threads = f", torch threads: {doc['torch_threads']}" if doc["environment"]["device"] == "cpu" else ""
        parts.append(f"**{describe_environment(doc['environment'])}** — {doc['date'][:10]}{threads}, "
                     f"`{doc['tier']}` sizes, from `{name}`"
                     + (f" ({left_out} case(s) not run there: see the file)" if left_out else "") + "\n")
        parts.append(render_markdown(BENCH_COLUMNS, [bench_cells(r) for r in measured]) + "\n")
    for path, doc in _gpu_first(compare):
        parts.append(compare_summary(doc, rel(path)))
    older = sorted(earlier + earlier_compare, key=lambda item: item[0].name)
    if older:
        parts.append("Earlier GPU runs (each device's newest run is above): "
                     + ", ".join(f"`{rel(p)}`" for p, _ in older) + ".\n")
    if not parts:
        parts.append("No benchmark results committed yet.\n")
    return "\n".join(parts)


def splice(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block``."""
    if not has_block(readme):
        raise ValueError(f"readme: expected one {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN)
    tail = rest.split(END)[1]
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def has_block(text: str) -> bool:
    """Whether ``text`` holds exactly one ``BEGIN ... END`` block (what :func:`splice` needs)."""
    return text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


def regenerate(readme: Path | None = None, results_dir: Path | None = None, *,
               check: bool = False) -> tuple[Path, bool]:
    """Rewrite (with ``check``: only compare) the table block of ``readme``; ``(readme, fresh)``.

    ``readme`` defaults to this checkout's ``README.md``, ``results_dir`` to ``benchmarks/results``
    next to the README. ValueError (one line, naming the flag) for a README without the block or
    a missing results folder: an empty folder would silently replace every table.
    """
    readme = ROOT / "README.md" if readme is None else Path(readme)
    if not readme.is_file():
        raise ValueError(f"--readme: {readme} is not a file")
    if not has_block(readme.read_text()):
        raise ValueError(f"--readme: {readme} has no single {BEGIN} ... {END} block; "
                         f"pass --readme PATH of a README that has one")
    results_dir = readme.parent / "benchmarks" / "results" if results_dir is None else Path(results_dir)
    if not results_dir.is_dir():
        raise ValueError(f"--results: {results_dir} is not a directory; pass --results DIR")
    return readme, update_readme(readme, results_dir, check=check)


def update_readme(readme: Path, results_dir: Path, *, check: bool = False) -> bool:
    """Rewrite (or with ``check`` only compare) the README block; True if it was up to date."""
    readme = Path(readme)
    text = readme.read_text()
    new = splice(text, readme_block(results_dir, readme.parent))
    if new == text:
        return True
    if not check:
        readme.write_text(new)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--readme", type=Path, metavar="PATH",
                   help="the README to rewrite (default: README.md of the checkout holding this file)")
    p.add_argument("--results", type=Path, metavar="DIR",
                   help="result files (default: benchmarks/results next to the README)")
    p.add_argument("--check", action="store_true", help="only check; exit 1 if the README is stale")
    args = p.parse_args(argv)
    try:
        readme, fresh = regenerate(args.readme, args.results, check=args.check)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not fresh:
            print(f"{readme} benchmark table is out of date: run {PROG}", file=sys.stderr)
            return 1
        print(f"{readme} benchmark table is up to date")
    else:
        print(f"{readme} benchmark table " + ("already up to date" if fresh else "rewritten"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
