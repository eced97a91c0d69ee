"""Result rows as text: the tables of ``fastspec bench`` and ``fastspec compare``.

Cells and labels of one row (:func:`bench_cells`, :func:`compare_cells`, the noise rule of
:data:`NOISE_RULE`), the narrow per-suite view of ``fastspec bench`` (:func:`bench_text`), the
one-table view (:func:`render_text`; ``--wide``) and the verdict lines. The README's tables are
built from the same cells by a developer tool outside the package, ``benchmarks/readme_table.py``.
"""
from __future__ import annotations

# every field in one row: the README's tables and ``fastspec bench --wide``
BENCH_COLUMNS = ("suite", "size", "variant", "fastspec", "baseline", "baseline time", "speedup",
                 "throughput", "accuracy")
COMPARE_COLUMNS = ("family", "n", "variant", "fastspec err", "torch fp32 err", "ratio", "bound")
WIDTH = 100  # the terminal view's notes are wrapped to this; its tables stay near it (see bench_text)

NOISY_PCT = 50  # the widest ±X% that still prints as ≈1× / ≈0; wider is "inconclusive"

NOISE_RULE = (
    "Noise: a time difference counts only when the repeats of the two sides do not overlap (every "
    "fastspec repeat faster than every baseline repeat, or every one slower); then the number is "
    "printed, however wide the spread. Otherwise ±X% is the largest gap between a fastspec repeat "
    "and a baseline repeat, (max ratio − 1) or (1 − min ratio), and the speedup prints as ≈1× and "
    f"the overhead as ≈0 (±X%) when X ≤ {NOISY_PCT}, or as 'inconclusive (noisy: ±X%)' when X > "
    f"{NOISY_PCT}: the repeats then allow no difference and a large one alike, so neither ≈0 nor the "
    "medians' difference can be trusted (rerun with more --repeats, or --threads 1 on a shared "
    "machine). With a single repeat there is no spread to judge by and the number says so.")
NOISE_LEGEND = ("≈1× / ≈0: within noise, the repeats of fastspec and of the baseline overlap; ±X% is the "
                f"largest gap between one of each. inconclusive (noisy: ±X%): they overlap, but X > {NOISY_PCT}: "
                "the medians beside it are no measure of the difference either (fastspec bench --help).")


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def fmt_num(x: float | None, spec: str = ".2g") -> str:
    return "—" if x is None else format(x, spec)


def time_ratio_band(row: dict) -> tuple[float, float] | None:
    """``(lo, hi)``: every ratio of a fastspec repeat's time to a baseline repeat's lies in it,
    ``lo = fastspec_min_s / baseline_max_s``, ``hi = fastspec_max_s / baseline_min_s``. None for
    a row without the spread (results written before it was recorded) or a single repeat."""
    keys = ("fastspec_min_s", "fastspec_max_s", "baseline_min_s", "baseline_max_s")
    if row.get("repeats", 0) < 2 or any(row.get(k) is None for k in keys):
        return None
    return row["fastspec_min_s"] / row["baseline_max_s"], row["fastspec_max_s"] / row["baseline_min_s"]


def noise_pct(row: dict) -> float | None:
    """The ±X% of :data:`NOISE_RULE` when the difference is within noise (``lo ≤ 1 ≤ hi``), else
    None: then the medians' difference stands (or the spread is unknown: :func:`time_ratio_band`)."""
    band = time_ratio_band(row)
    if band is None or not band[0] <= 1 <= band[1]:
        return None
    return 100 * max(1 - band[0], band[1] - 1)


def _within_noise(row: dict, same: str) -> str | None:
    """The text of a difference within noise, or None when the number stands (:data:`NOISE_RULE`).

    Three cases, by the band ``[lo, hi]`` of fastspec-to-baseline time ratios over the repeats
    (:func:`time_ratio_band`) and ``X = noise_pct(row)``:

    * the band excludes 1 (no overlap): None, the medians' number is printed however wide the band;
    * it contains 1 and ``X ≤ NOISY_PCT``: ``same`` with ``(±X%)`` (``≈0 (±12%)``): no difference
      is possible and any there is lies within ±X%;
    * it contains 1 and ``X > NOISY_PCT``: ``inconclusive (noisy: ±X%)``: both "no difference" and
      a large one fit the repeats. (Inside the band the medians' own difference is at most X, so a
      spread this wide also exceeds the estimate it would qualify: ``≈0 (±3874%)`` beside medians
      of 1.09 s and 98.5 ms said "no overhead" where the measurement says nothing.)

    X is compared as printed (rounded to a whole percent), so ``±50%`` is the last ≈ and ``±51%``
    the first inconclusive."""
    noise = noise_pct(row)
    if noise is None:
        return None
    if round(noise) > NOISY_PCT:
        return f"inconclusive (noisy: ±{noise:.0f}%)"
    return f"{same} (±{noise:.0f}%)"


def _single(row: dict) -> str:
    # a row with the spread fields but one repeat: no noise estimate, and the reader is told
    return " (1 repeat)" if row.get("repeats") == 1 and "fastspec_min_s" in row else ""


def speedup_text(row: dict) -> str:
    """``baseline_s / fastspec_s`` as ``1.82×``; within noise ``≈1× (±12%)``, or ``inconclusive
    (noisy: ±80%)`` when the spread is too wide for that (:func:`_within_noise`)."""
    return _within_noise(row, "≈1×") or f"{row['speedup']:.2f}×{_single(row)}"


def overhead_text(row: dict) -> str:
    """``overhead_pct`` as ``+68.1%``; within noise ``≈0 (±12%)``, or ``inconclusive (noisy:
    ±3874%)`` when the spread is too wide for ≈0 (:func:`_within_noise`). Never a negative number
    that the noise allows: that would read as a speed-up the probe cannot give."""
    return _within_noise(row, "≈0") or f"{row['overhead_pct']:+.1f}%{_single(row)}"


def budget_text(row: dict, compact: bool = False) -> str:
    """A ``budget`` suite row (:mod:`fastspec.bench.suites.budget`): the real overhead against the
    twin (and the same model detached) beside what the probe reported over the same steps;
    ``compact`` (the terminal's narrow tables, whose variant names the budget already): without
    the ratio and the budget. A row without the same-model baseline (the HF Trainer row: only a
    twin trainer) shows the real overhead against the twin alone."""
    rep, ratio = row.get("reported_pct"), row.get("reported_to_real")
    real, same = row["real_overhead_pct"], row.get("same_model_overhead_pct")
    reported = "-" if rep is None else f"{rep:.2f}%"
    if compact:  # under the "overhead" header: 44 columns at most, even at +1234.56%
        return f"{real:+.2f}%{'' if same is None else f' (same {same:+.2f}%)'}, reported {reported}"
    return (f"real {real:+.2f}%{'' if same is None else f' (same model {same:+.2f}%)'}, reported {reported}"
            f"{'' if ratio is None else f' (×{ratio:.2f})'}, budget {row['budget_pct']:g}%")


DEVICE_MARK = "†"
DEVICE_LEGEND = ("† device time: a spin kernel kept the GPU busy while the host queued the call, so the "
                 "time is the kernels' alone, without the host's launch time (what the call costs "
                 "inside a training step, where launches overlap earlier work); --json has each "
                 "side's host time per call (fastspec_host_s, baseline_host_s).")


def _on_device_clock(row: dict, side: str) -> bool:
    """Whether ``side`` (``fastspec`` or ``baseline``) of ``row`` was timed on the device clock."""
    return row.get("clock" if side == "fastspec" else "baseline_clock") == "device"


def clocked_time(row: dict, side: str) -> str:
    """``fmt_time`` of ``side``'s time, then ``(device; host …)`` on the device clock."""
    text = fmt_time(row[f"{side}_s"])
    if _on_device_clock(row, side):
        host = row.get(f"{side}_host_s")
        text += f" (device; host {fmt_time(host)})" if host is not None else " (device)"
    return text


def bench_cells(row: dict) -> dict[str, str]:
    """One result row as table cells (see :mod:`fastspec.bench.runner` for the fields)."""
    cells = {k: "" for k in BENCH_COLUMNS}
    cells.update(suite=row["suite"], size=row["size"], variant=row["variant"],
                 baseline=row.get("baseline", ""))
    if row.get("layers") and row.get("layers_requested") and row["layers"] != row["layers_requested"]:
        cells["size"] += f" (run with {row['layers']:g} layers to fit)"  # see the case's note row
    if "skipped" in row or ("error" in row and "fastspec_s" not in row):
        cells["fastspec"] = f"skipped: {row['skipped']}" if "skipped" in row else f"ERROR: {row['error']}"
        return cells
    cells.update({"fastspec": clocked_time(row, "fastspec"), "baseline time": clocked_time(row, "baseline"),
                  "speedup": speedup_text(row)})
    if row.get("baseline_scale"):  # timed on a slice of the batch, scaled to the whole
        cells["baseline time"] += f" (slice ×{row['baseline_scale']:g})"
    if "rate_unit" in row:
        cells["throughput"] = f"{row['fastspec_rate']:.3g} vs {row['baseline_rate']:.3g} {row['rate_unit']}"
    if "overhead_pct" in row:
        cells["throughput"] = f"overhead {overhead_text(row)} of step"
    if "real_overhead_pct" in row:
        cells["throughput"] = budget_text(row)
    acc = f"{row['error_kind']}: {fmt_num(row['fastspec_error'])}"
    if row.get("baseline_error") is not None:
        acc += f" (baseline {fmt_num(row['baseline_error'])})"
    if row.get("pr_diff_vs_baseline") is not None:
        acc += f"; max |ΔPR| vs baseline {fmt_num(row['pr_diff_vs_baseline'])}"
    if "error" in row:
        acc += f" ERROR: {row['error']}"
    if row.get("claim_held") is False:
        acc += f" FAIL: {row['claim_violation']}"
    cells["accuracy"] = acc
    return cells


def bound_label(row: dict) -> str:
    """Where a measured ``fastspec compare`` row stands against its bound (see
    :func:`fastspec.bench.accuracy.within_bound`), from the exact errors, never the rounded
    ratio: ``≤ 2×`` (fastspec error ≤ 2 × torch's), ``≤ 2× + 8·eps`` (above 2× but within the
    floor), ``FAIL``."""
    from .case import FLOOR_EPS

    if not row.get("within_2x_torch"):
        return "FAIL"
    if row["fastspec_error"] <= 2 * row["torch_fp32_error"]:
        return "≤ 2×"
    return f"≤ 2× + {FLOOR_EPS}·eps"


def compare_cells(row: dict) -> dict[str, str]:
    cells = {"family": row["family"], "n": str(row["n"]), "variant": row.get("variant", "")}
    if "skipped" in row:
        return {**cells, "fastspec err": f"skipped: {row['skipped']}"}
    if "error" in row:
        return {**cells, "fastspec err": f"ERROR: {row['error']}", "bound": "FAIL"}
    return {**cells, "fastspec err": fmt_num(row["fastspec_error"]),
            "torch fp32 err": fmt_num(row["torch_fp32_error"]), "ratio": fmt_num(row["ratio"], ".3f"),
            "bound": bound_label(row)}


def compare_verdict(rows: list[dict]) -> tuple[bool, str]:
    """``(passed, line)``: the last line of ``fastspec compare``. Every (family, n, variant) that
    ran must hold the bound; one that raised fails; one the time cap left out is neither."""
    from .case import FLOOR_EPS

    ran = [r for r in rows if "skipped" not in r]
    bad = [r for r in ran if not r.get("within_2x_torch")]
    floor = sum(bound_label(r).startswith("≤ 2× +") for r in ran if r not in bad)
    bound = f"2× torch.linalg fp32's error vs fp64 (+ {FLOOR_EPS}·eps floor)"
    capped = f"; {len(rows) - len(ran)} not run (time cap)" if len(ran) < len(rows) else ""
    if not ran:
        return True, f"NO RESULT: no case ran{capped}"
    if not bad:
        used = f"; {floor} within it only by the floor" if floor else ""
        return True, f"PASS: all {len(ran)} cases within {bound}{used}{capped}"
    worst = ", ".join(f"{r['family']} n={r['n']} {r.get('variant', '')}"
                      + (" raised" if "error" in r else f" ratio {fmt_num(r.get('ratio'), '.3f')}")
                      for r in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return False, f"FAIL: {len(bad)} of {len(ran)} cases exceed {bound}: {worst}{more}{capped}"


def claims_verdict(rows: list[dict]) -> str | None:
    """The last line of ``fastspec bench`` when some case's errors break its accuracy claim
    (``claim_held`` false on its rows), naming the cases; None when none does."""
    bad = list(dict.fromkeys(f"{r['suite']} {r['size']} {r['variant']}"
                             for r in rows if r.get("claim_held") is False))
    if not bad:
        return None
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    verb = "breaks its" if len(bad) == 1 else "break their"
    return f"FAIL: {_count(len(bad))} {verb} accuracy claim (the FAIL notes say how): {', '.join(bad[:5])}{more}"


def render_text(columns: tuple[str, ...], cells: list[dict[str, str]], right: tuple[str, ...] = (),
                indent: str = "") -> str:
    """A plain-text table: header, rule, one line per cell dict; ``right``: right-aligned columns."""
    widths = [max([len(c)] + [len(r.get(c, "")) for r in cells]) for c in columns]

    def line(values: list[str]) -> str:
        return indent + "  ".join(v.rjust(w) if c in right else v.ljust(w)
                                  for c, v, w in zip(columns, values, widths)).rstrip()

    return "\n".join([line(list(columns)), indent + "  ".join("-" * w for w in widths)]
                     + [line([r.get(c, "") for c in columns]) for r in cells])


def _count(n: int) -> str:
    return f"{n} case" + ("s" if n != 1 else "")


def _compact_cells(row: dict) -> dict[str, str]:
    scaled = "*" if row.get("baseline_scale") else ""  # see the section's footnote

    def mark(side: str) -> str:  # see DEVICE_LEGEND
        return DEVICE_MARK if _on_device_clock(row, side) else ""

    cells = {"size": row["size"], "variant": row["variant"],
             "fastspec": fmt_time(row["fastspec_s"]) + mark("fastspec"),
             "baseline": fmt_time(row["baseline_s"]) + scaled + mark("baseline"),
             "speedup": speedup_text(row), "overhead": overhead_text(row) if "overhead_pct" in row else ""}
    if "real_overhead_pct" in row:  # a budget row: the long paired run's means and overhead, not the medians'
        cells.update(fastspec=fmt_time(row["probed_mean_s"]), baseline=fmt_time(row["twin_mean_s"]),
                     overhead=budget_text(row, compact=True))
    if "rate_unit" in row:
        cells["rate"] = f"{row['fastspec_rate']:.3g} vs {row['baseline_rate']:.3g}"
    err = fmt_num(row["fastspec_error"])
    if row.get("baseline_error") is not None:
        err += f" ({fmt_num(row['baseline_error'])})"
    cells["error"] = err + (" ERROR" if "error" in row else "") + (" FAIL" if row.get("claim_held") is False else "")
    if row.get("pr_diff_vs_baseline") is not None:
        cells["|ΔPR|"] = fmt_num(row["pr_diff_vs_baseline"])
    return cells


def bench_text(rows: list[dict], width: int = WIDTH) -> str:
    """The terminal view of ``fastspec bench``: per suite, one table per (baseline, error kind)
    with the columns its rows fill, then one line per group of rows that were not measured.

    Each table: size, variant, median times of fastspec and the baseline, ``speedup`` (or
    ``overhead`` for a probe on top of its baseline: :func:`overhead_text`), the throughput as
    ``fastspec vs baseline`` under its unit, the error as ``fastspec (baseline)`` and ``|ΔPR|``
    where the case has it, marked ``FAIL`` when it breaks the case's accuracy claim
    (:class:`~fastspec.bench.case.Claim`; the note below the table says how). Long texts
    (baseline names, error kinds, skip reasons, violations) are in the titles and notes, so a
    table is about as wide as its numbers; everything else is in ``--json`` (all fields) and
    ``--wide`` (the README's one-table layout).
    """
    import textwrap

    suites: dict[str, tuple[dict, dict[tuple[str, str, str], int]]] = {}
    for r in rows:
        tables, notes = suites.setdefault(r["suite"], ({}, {}))
        if "fastspec_s" in r:
            tables.setdefault((r["baseline"], r["error_kind"]), []).append(r)
        if r.get("claim_held") is False:  # on every row of the case: one note, not one per baseline
            notes.setdefault(("FAIL", f"{r['size']} {r['variant']}", r["claim_violation"]), 1)
        if "error" in r:
            note = ("ERROR", f"{r['size']} {r['variant']}", r["error"])
        elif "skipped" in r:  # a baseline (or the requested depth) left out, or the whole case
            note = ("not run", r["baseline"], r["skipped"]) if "baseline" in r else (
                "skipped", f"variant {r['variant']}", r["skipped"])
        else:
            continue
        notes[note] = notes.get(note, 0) + 1
    out, noisy, device = [], False, False
    for suite, (tables, notes) in suites.items():
        for (baseline, kind), group in tables.items():
            cells = [_compact_cells(r) for r in group]
            cols = ["size", "variant", "fastspec", "baseline"]
            cols += [c for c in ("speedup", "overhead", "rate", "error", "|ΔPR|") if any(x.get(c) for x in cells)]
            if "overhead" in cols:  # the probe's cost on top of its baseline: the speedup repeats it
                cols.remove("speedup")
            units = sorted({r["rate_unit"] for r in group if "rate_unit" in r})
            header = {"rate": " / ".join(units), "error": "error (baseline)" if any(
                r.get("baseline_error") is not None for r in group) else "error"}
            cells = [{header.get(c, c): x.get(c, "") for c in cols} for x in cells]
            noisy = noisy or any(x.startswith(("≈", "inconclusive")) for c in cells for x in c.values())
            device = device or any(_on_device_clock(r, side) for r in group for side in ("fastspec", "baseline"))
            out += ["", f"{suite} vs {baseline} · error: {kind}",
                    render_text(tuple(header.get(c, c) for c in cols), cells, indent="  ",
                                right=("fastspec", "baseline", "speedup", "overhead"))]
            scales = sorted({r["baseline_scale"] for r in group if r.get("baseline_scale")})
            if scales:
                out += textwrap.wrap("* timed on a slice of the batch and scaled to all of it (×"
                                     + ", ×".join(f"{k:g}" for k in scales) + ")", width,
                                     initial_indent="  ", subsequent_indent="    ")
        if not tables:
            out += ["", suite]
        for (what, subject, text), n in notes.items():
            out += textwrap.wrap(f"{what:<8} {subject}" + (f" ({_count(n)})" if n > 1 else "") + f" — {text}",
                                 width, initial_indent="  ", subsequent_indent=" " * 11)
    for legend, shown in ((NOISE_LEGEND, noisy), (DEVICE_LEGEND, device)):
        if shown:
            out += [""] + textwrap.wrap(legend, width)
    return "\n".join(out).lstrip("\n")


def describe_environment(env: dict) -> str:
    """``device (driver, CUDA) · torch · triton · fastspec`` in one line."""
    device = env["device"] if env["device"] != "cpu" else f"CPU: {env.get('cpu', 'cpu')}"
    if env.get("driver") or env.get("cuda"):
        device += f" (driver {env.get('driver') or '?'}, CUDA {env.get('cuda') or '?'})"
    return (f"{device} · torch {env['torch']} · triton {env.get('triton') or 'not installed'}"
            f" · fastspec {env['fastspec']}")


