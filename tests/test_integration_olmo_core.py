"""OLMo-core integration (``fastspec.integrations.olmo_core.FastspecCallback``) in real training runs.

Each run is ``tests/_olmo_core_train.py`` under torchrun (gloo, CPU, one thread per rank): a tiny
OLMo-core transformer trained 6 steps, the probe streaming keys and FFN with ``emit_every=2``
(emissions at steps 2, 4, 6, each over 2 steps × 4 sequences × 32 tokens = 256 tokens). A run
takes 5–15 s; runs are cached per module, so tests sharing one pay for it once.

* FSDP on 2 ranks streams the records of one process on the same tokens (the same forwards: the
  reference runs the same micro-batches with gradient accumulation), to 1e-6 relative;
* activation checkpointing (OLMo-core's ``full`` and ``selected_modules``): every token counted
  once (``n``), values equal to the run without it;
* checkpoint resume: 3 steps, save, a fresh run from the checkpoint to step 6 gives the records of
  the uninterrupted run (restored accumulators, schedule and history);
* ``emit_on="rank0"``: only rank 0 keeps records and logs metrics, and its metrics reach
  OLMo-core's loggers;
* bad arguments raise one-line errors naming the argument; an untested OLMo-core version warns
  once at import; ``import fastspec.integrations`` does not import OLMo-core.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
from _integrations import ROOT, check_version_warning, env, runner

pytest.importorskip("olmo_core")
# each test trains under torchrun with 2 ranks, which fill a 2-core machine: run alone (a second
# worker beside them made the stage slower, 192 -> 214 s, and brings the runs' timeouts closer)
pytestmark = pytest.mark.serial

HARNESS = ROOT / "tests" / "_olmo_core_train.py"
STEPS, EMIT_EVERY, TOKENS_PER_STEP = 6, 2, 4 * 32  # the harness's defaults: 4 sequences of 32 tokens
EMISSIONS = (2, 4, 6)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(*args, nproc=2)`` -> each rank's output of the harness (cached per argument list)."""
    return runner(tmp_path_factory, HARNESS, "--steps", str(STEPS))


def _values(records) -> dict[tuple, float]:
    """``{(step, site, layer, head, metric): value}`` without the probe's own overhead (a timing)."""
    return {(r["step"], r["site"], r["layer"], r["head_index"], r["metric"]): r["value"]
            for r in records if r["site"] != "probe"}


def _assert_same(got: dict, want: dict, rel: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-12)}
    assert not bad, f"{len(bad)} of {len(want)} values differ, e.g. {next(iter(bad.items()))}"


def _assert_each_token_once(records) -> None:
    """Every emission's ``n`` (rows merged per site, layer, head) is the tokens of its 2 steps."""
    n = {k: v for k, v in _values(records).items() if k[4] == "n"}
    assert {k[0] for k in n} == set(EMISSIONS)
    assert set(n.values()) == {EMIT_EVERY * TOKENS_PER_STEP}
    assert {r["tokens_seen"] for r in records if r["metric"] == "n"} == {s * TOKENS_PER_STEP for s in EMISSIONS}


def test_fsdp_two_ranks_stream_the_records_of_one_process(run):
    ref = run("--emit-on", "all", nproc=1)[0]
    ranks = run("--fsdp", "--emit-on", "all")
    want = _values(ref["records"])
    assert {k[1] for k in want} == {"keys", "ffn"} and {k[3] for k in want if k[1] == "keys"} == {0, 1}
    _assert_each_token_once(ref["records"])
    for out in ranks:  # sync="all": every rank has the global metrics
        assert out["world_size"] == 2
        _assert_same(_values(out["records"]), want)
        _assert_each_token_once(out["records"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selected_modules"])
def test_activation_checkpointing_counts_each_token_once(run, mode):
    """The forward that checkpointing recomputes in backward is not counted again."""
    plain = run("--fsdp", "--emit-on", "all")
    ranks = run("--fsdp", "--emit-on", "all", "--ac", mode)
    for out, ref in zip(ranks, plain):
        _assert_each_token_once(out["records"])
        _assert_same(_values(out["records"]), _values(ref["records"]))


@pytest.mark.slow
def test_resume_from_checkpoint_continues_the_uninterrupted_run(run, tmp_path):
    """Stopped after step 3 (its accumulators hold step 3's tokens, not emitted yet) and resumed in
    a fresh torchrun: records of steps 2 (restored), 4 (restored + new tokens) and 6 equal the run
    that never stopped, on each rank."""
    whole = run("--fsdp", "--emit-on", "all")
    # the same data (--batches), stopped at step 3 (a later --steps wins over the fixture's)
    part = run("--fsdp", "--emit-on", "all", "--batches", str(STEPS), "--save-folder", str(tmp_path / "part"),
               "--steps", "3")
    assert part[0]["global_step"] == 3 and {r["step"] for r in part[0]["records"]} == {2}
    resumed = run("--fsdp", "--emit-on", "all", "--load-path", str(tmp_path / "part" / "step3"),
                  "--save-folder", str(tmp_path / "resumed"))
    for out, ref in zip(resumed, whole):
        assert out["global_step"] == STEPS
        _assert_same(_values(out["records"]), _values(ref["records"]))
        _assert_each_token_once(out["records"])
        # only the steps after the resume were logged by this run, step 4 with the restored tokens
        logged = {int(s) for s, m in out["metrics"].items() if any(k.startswith("fastspec/") for k in m)}
        assert logged == {4, 6}


def test_evaluator_callback_forwards_do_not_reach_the_streaming_totals(run):
    """OLMo-core's in-loop evaluation (eval mode, no_grad) at startup and after every step from
    step 2: the streamed records are those of the run without it, every token counted once."""
    evaluated = run("--emit-on", "all", "--eval-every", "1", nproc=1)[0]
    assert len(evaluated["evaluations"]) == 1 + (STEPS - 1)  # it did evaluate: startup, steps 2..6
    plain = run("--emit-on", "all", nproc=1)[0]
    _assert_each_token_once(evaluated["records"])
    assert _values(evaluated["records"]) == _values(plain["records"])  # bit for bit


def test_emit_on_rank0_only_rank0_keeps_records_and_logs(run):
    """Default sync follows emit_on ("rank0"); rank 0's values are the global ones, and what it
    logs is ``scalars`` of each emission, in the metrics OLMo-core hands its loggers."""
    from fastspec.integrations import scalars

    rank0, rank1 = run("--fsdp", "--emit-on", "rank0")
    assert rank1["records"] == []
    assert not any(k.startswith("fastspec/") for m in rank1["metrics"].values() for k in m)
    _assert_same(_values(rank0["records"]), _values(run("--emit-on", "all", nproc=1)[0]["records"]))
    for step in range(1, STEPS + 1):
        logged = {k: v for k, v in rank0["metrics"][str(step)].items() if k.startswith("fastspec/")}
        want = scalars([r for r in rank0["records"] if r["step"] == step])
        assert logged == want
        assert bool(logged) == (step in EMISSIONS)
    assert "fastspec/stream/keys/participation_ratio/layer1" in rank0["metrics"]["2"]


# ------------------------------------------------------------------ arguments, version, import
@pytest.mark.parametrize("kwargs, name", [
    ({"emit_on": "rank1"}, "emit_on"),
    ({"prefix": ""}, "prefix"),
    ({"prefix": 3}, "prefix"),
    ({"probe_kwargs": ["keys"]}, "probe_kwargs"),
    ({"probe": "keys"}, "probe"),
    ({"probe": lambda m, process_group=None: None, "probe_kwargs": {}}, "probe_kwargs"),
    ({"alerts": "collapse"}, "alerts"),
    ({"console": 1}, "console"),
    ({"emit_on": "all", "probe_kwargs": {"sync": "rank0"}}, "emit_on"),
])
def test_bad_arguments_raise_one_line_errors_naming_them(kwargs, name):
    from fastspec.integrations.olmo_core import FastspecCallback

    with pytest.raises((TypeError, ValueError)) as info:
        FastspecCallback(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{name}:") and "\n" not in message


def test_good_arguments_are_kept():
    from fastspec.integrations.alerts import RankCollapseAlert
    from fastspec.integrations.olmo_core import FastspecCallback

    alert = RankCollapseAlert(drop=0.5)
    cb = FastspecCallback(probe_kwargs={"emit_every": 10}, emit_on="all", prefix="spec", alerts=alert)
    assert (cb.probe_kwargs, cb.emit_on, cb.prefix, cb.alerts, cb.probe, cb.records) == (
        {"emit_every": 10}, "all", "spec", alert, None, [])
    assert cb.state_dict() == {}  # before pre_train (OLMo-core's step-0 checkpoint): nothing yet


@pytest.mark.parametrize("version, warns", [("3.1.0", True), ("2.4.1", True), ("3.0.0", False), ("3.0.9", False)])
def test_untested_olmo_core_version_warns_once_at_import(monkeypatch, version, warns):
    import fastspec.integrations.olmo_core as module

    check_version_warning(monkeypatch, module, "ai2-olmo-core", version, warns)


def test_version_range_without_packaging(monkeypatch):
    """The fallback compare (no ``packaging``) agrees with the specifier."""
    import fastspec.integrations.olmo_core as module
    from fastspec.integrations._versions import in_range

    monkeypatch.setitem(sys.modules, "packaging.specifiers", None)  # import raises ImportError
    assert [in_range(v, module.TESTED) for v in ("3.0.0", "3.0.12", "3.1.0", "2.9.9", "4.0", "dev")] == [
        True, True, False, False, False, False]


def test_import_fastspec_integrations_does_not_import_olmo_core():
    code = ("import sys, fastspec, fastspec.integrations, fastspec.integrations.alerts\n"
            "assert 'olmo_core' not in sys.modules, sorted(m for m in sys.modules if 'olmo' in m)\n"
            "import fastspec.integrations.olmo_core\n"
            "assert 'olmo_core' in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
