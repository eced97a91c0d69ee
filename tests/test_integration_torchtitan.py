"""``fastspec.integrations.torchtitan``: the probe inside TorchTitan's own trainer, on 2 gloo ranks.

Each run is TorchTitan's training loop in a ``torchrun`` subprocess (``tests/_torchtitan_train.py``,
config ``tests/_torchtitan_configs.py``: a tiny llama3 on synthetic tokens, with the CPU
workarounds those files list). Every run starts from one seed checkpoint, so runs of any
parallelism share their initial weights, and every split of the global batch feeds the same tokens:
a sharded run's records must then equal those of one process with the whole batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
# each test trains under torchrun with 2 ranks, which fill a 2-core machine: run alone (a second
# worker beside them made the stage slower, 192 -> 214 s, and brings the runs' timeouts closer)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "tests" / "_torchtitan_train.py"
GLOBAL_BATCH, SEQ_LEN = 8, 32      # tests/_torchtitan_configs.py: SEQ_LEN; the global batch is ours
N_KV_HEADS = 2
RTOL = 1e-6


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _run(out: Path, nproc: int, *args: str, config: str = "tiny", timeout: int = 240) -> dict:
    """Train in ``torchrun`` with ``nproc`` ranks; returns ``{"ranks": [records-rank r], "metrics": [...]}``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(LAUNCHER), "--module", "tests._torchtitan_configs", "--config", config,
           "--dump_folder", str(out), *args]
    res = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        pytest.fail(f"torchrun failed ({res.returncode}):\n{(res.stdout + res.stderr)[-6000:]}", pytrace=False)
    ranks = [json.loads((out / f"records-rank{r}.json").read_text()) if (out / f"records-rank{r}.json").exists()
             else None for r in range(nproc)]
    metrics = out / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"ranks": ranks, "metrics": lines, "log": res.stdout + res.stderr}


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> str:
    """One set of initial weights for every run (a sharded init draws other numbers)."""
    out = tmp_path_factory.mktemp("seed")
    _run(out, 1, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--fastspec.no-enable")
    return str(out / "checkpoint" / "step-0")


def _from_seed(seed: str) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", seed, "--checkpoint.load_only"]


def _batch(nproc_dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // nproc_dp)]


@pytest.fixture(scope="module")
def reference(seed, tmp_path_factory) -> dict:
    """One process, the whole global batch, keys + FFN, emitting every 2 of 4 steps."""
    return _run(tmp_path_factory.mktemp("ref"), 1, *_from_seed(seed), *_batch(1))


@pytest.fixture(scope="module")
def fsdp(seed, tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("fsdp"), 2, *_from_seed(seed), *_batch(2),
                "--parallelism.data_parallel_shard_degree", "2")


def _key(r: dict) -> tuple:
    return r["step"], r["site"], r["layer"], r["head_index"], r["metric"]


def _by_key(records: list[dict]) -> dict:
    out = {}
    for r in records:
        assert _key(r) not in out, f"record {_key(r)} twice"
        out[_key(r)] = r
    return out


def _assert_same_records(got: list[dict], want: list[dict], *, sites=None) -> None:
    """Same (step, site, layer, head, metric) set and values to RTOL; ``overhead_fraction`` (a
    timing) and other-site records of ``want`` are left out."""
    def keep(r):
        return r["metric"] != "overhead_fraction" and (sites is None or r["site"] in sites)

    g, w = _by_key([r for r in got if keep(r)]), _by_key([r for r in want if keep(r)])
    assert g.keys() == w.keys()
    assert g, "no records"
    bad = [(k, g[k]["value"], w[k]["value"]) for k in w
           if not abs(g[k]["value"] - w[k]["value"]) <= RTOL * max(abs(w[k]["value"]), 1e-12)]
    assert not bad, f"{len(bad)} of {len(w)} records differ, e.g. {bad[:5]}"
    assert {k: g[k]["tokens_seen"] for k in g} == {k: w[k]["tokens_seen"] for k in w}


def _tokens_counted(records: list[dict], site: str) -> set[float]:
    return {r["value"] for r in records if r["site"] == site and r["metric"] == "n"}


# ----------------------------------------------------------------------------------- runs
def test_fsdp_records_equal_one_process_with_the_global_batch(reference, fsdp):
    """FSDP=2: keys and FFN records (merged over the data-parallel group) equal one process's
    with the whole batch; both ranks hold them (sync="all"), rank 0 logged them."""
    want = reference["ranks"][0]["logged"]
    assert {r["site"] for r in want} >= {"keys", "ffn"}
    for rank in fsdp["ranks"]:
        _assert_same_records(rank["history"], want)
    _assert_same_records(fsdp["ranks"][0]["logged"], want)
    # selective activation checkpointing (the config's default) recomputes the attention hooks:
    # the tokens are still counted once, 2 steps of the global batch per emission
    assert _tokens_counted(want, "keys") == _tokens_counted(fsdp["ranks"][0]["logged"], "keys") \
        == {2.0 * GLOBAL_BATCH * SEQ_LEN}


def test_metrics_processor_gets_the_scalars(fsdp):
    """The metrics processor's logger (a test logger writing JSON lines on rank 0) receives
    ``fastspec.integrations.scalars`` of each emission at its step, next to TorchTitan's loss."""
    from fastspec.integrations import scalars

    logged = fsdp["ranks"][0]["logged"]
    steps = sorted({r["step"] for r in logged})
    assert steps == [2, 4]
    calls = {}
    for line in fsdp["metrics"]:
        fs = {k: v for k, v in line["metrics"].items() if k.startswith("fastspec/")}
        if fs:
            assert line["step"] not in calls, "one scalars call per emission"
            calls[line["step"]] = fs
    assert sorted(calls) == steps
    for step in steps:
        want = scalars([r for r in logged if r["step"] == step])
        assert "fastspec/stream/keys/participation_ratio/mean" in want
        assert calls[step].keys() == want.keys()
        assert all(calls[step][k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
    assert any("loss_metrics/global_avg_loss" in line["metrics"] for line in fsdp["metrics"])


@pytest.mark.slow
def test_tp_records_carry_global_heads_and_equal_one_process(reference, seed, tmp_path):
    """TP=2: each rank reads its own KV head of a DTensor sharded over heads; the logging rank
    gets both ranks' heads, under their global indices, with the single-process values."""
    tp = _run(tmp_path, 2, *_from_seed(seed), *_batch(1), "--parallelism.tensor_parallel_degree", "2",
              "--fastspec.no-ffn")
    logged = tp["ranks"][0]["logged"]
    heads = {r["head_index"] for r in logged if r["site"] == "keys"}
    assert heads == set(range(N_KV_HEADS))
    # each rank measured its own head only
    for r, rank in enumerate(tp["ranks"]):
        own = {x["head_index"] for x in rank["history"] if x["site"] == "keys"}
        assert own == {r}
    _assert_same_records(logged, reference["ranks"][0]["logged"], sites={"keys"})


@pytest.mark.slow
def test_fsdp_with_per_block_compile_equals_eager(fsdp, seed, tmp_path):
    """FSDP=2 with each block compiled (``--compile.enable --compile.components model``): the same
    records as the eager FSDP run."""
    compiled = _run(tmp_path, 2, *_from_seed(seed), *_batch(2), "--parallelism.data_parallel_shard_degree", "2",
                    "--compile.enable", "--compile.components", "model", timeout=600)
    _assert_same_records(compiled["ranks"][0]["logged"], fsdp["ranks"][0]["logged"])


@pytest.mark.slow
def test_full_activation_checkpointing_counts_tokens_once(seed, tmp_path):
    """Full activation checkpointing reruns every block's forward in backward: the probe still
    counts each fed token once (``n`` = 2 steps × global batch × sequence)."""
    run = _run(tmp_path, 2, *_from_seed(seed), *_batch(2), "--parallelism.data_parallel_shard_degree", "2",
               config="tiny_full_ac")
    logged = run["ranks"][0]["logged"]
    for site in ("keys", "ffn"):
        assert _tokens_counted(logged, site) == {2.0 * GLOBAL_BATCH * SEQ_LEN}, site


@pytest.mark.slow
def test_validation_forwards_do_not_reach_the_streaming_totals(reference, seed, tmp_path):
    """TorchTitan's validator after every step (eval mode, no_grad, other tokens): the streamed
    records are those of the same run without it, bit for bit."""
    out = _run(tmp_path, 1, *_from_seed(seed), *_batch(1), config="tiny_validated")
    validated = [line["step"] for line in out["metrics"] if any(k.startswith("validation") for k in line["metrics"])]
    assert validated == [1, 2, 3, 4]  # it did validate, every step
    got, want = out["ranks"][0]["history"], reference["ranks"][0]["history"]
    _assert_same_records(got, want)
    keep = [(_key(r), r["value"]) for r in got if r["metric"] != "overhead_fraction"]
    assert keep == [(_key(r), r["value"]) for r in want if r["metric"] != "overhead_fraction"]


def test_resume_restores_the_probe_state(seed, tmp_path):
    """A run checkpointed at step 2 and resumed there emits at step 3 what the uninterrupted run
    emits: the streaming accumulators of steps 1-2 (per rank) and the schedule come back."""
    args = (*_from_seed(seed)[:3], *_batch(2), "--parallelism.data_parallel_shard_degree", "2",
            "--fastspec.emit_every", "3", "--checkpoint.interval", "2")
    whole = _run(tmp_path, 2, *args)
    want = whole["ranks"][0]["logged"]
    assert sorted({r["step"] for r in want}) == [3]
    assert (tmp_path / "checkpoint" / "step-2").is_dir()
    resumed = _run(tmp_path, 2, *args, "--checkpoint.load_step", "2")
    assert "Training starts at step 3" in resumed["log"]
    _assert_same_records(resumed["ranks"][0]["logged"], want)
    assert _tokens_counted(resumed["ranks"][0]["logged"], "keys") == {3.0 * GLOBAL_BATCH * SEQ_LEN}


# ------------------------------------------------------------------------------ in-process
@pytest.mark.parametrize("field, value, message", [
    ("emit_every", 0, "fastspec.emit_every: expected an int >= 1, got 0"),
    ("every", 1.5, "fastspec.every: expected an int >= 1, got 1.5"),
    ("budget", 2.0, "fastspec.budget: expected a fraction in (0, 1) or None, got 2.0"),
    ("emit_on", "rank1", "fastspec.emit_on: expected one of ('rank0', 'all'), got 'rank1'"),
    ("ffn_rows", 0, "fastspec.ffn_rows: expected 'auto', 'all' or an int >= 1, got 0"),
    ("prefix", "", "fastspec.prefix: expected a non-empty str, got ''"),
    ("keys", 1, "fastspec.keys: expected True or False, got 1"),
])
def test_bad_config_values_raise_one_line_errors(field, value, message):
    from fastspec.integrations.torchtitan import FastspecConfig

    with pytest.raises((ValueError, TypeError)) as err:
        FastspecConfig(**{field: value})
    assert str(err.value) == message


def test_bad_values_on_the_command_line_raise_naming_the_field(capsys):
    """TorchTitan's parser (tyro) stops with its usage error, which quotes our one-line message."""
    from torchtitan.config import ConfigManager

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", "tests._torchtitan_configs", "--config", "tiny",
                                    "--fastspec.emit_every", "0"])
    assert "fastspec.emit_every: expected an int >= 1, got 0" in capsys.readouterr().err


def test_no_site_and_pipeline_parallelism_are_refused():
    from torchtitan.config import ParallelismConfig

    from fastspec.integrations.torchtitan import FastspecConfig, FastspecTrainer

    with pytest.raises(ValueError, match="^fastspec.keys/queries/ffn/modules: no site selected"):
        FastspecConfig(enable=True, keys=False, ffn=False)
    FastspecConfig(enable=False, keys=False, ffn=False)  # off: nothing to check
    with pytest.raises(NotImplementedError, match="^parallelism.pipeline_parallel_degree: .* not support pipeline"):
        FastspecTrainer.Config(fastspec=FastspecConfig(enable=True),
                               parallelism=ParallelismConfig(pipeline_parallel_degree=2))
    # without the probe, pipeline parallelism is TorchTitan's business, not ours
    with pytest.raises(Exception) as err:
        FastspecTrainer.Config(parallelism=ParallelismConfig(pipeline_parallel_degree=2))
    assert not isinstance(err.value, NotImplementedError)


def test_the_example_registry_turns_the_probe_on():
    """docs/torchtitan.md's command: ``examples/torchtitan_llama3.py`` parses as TorchTitan parses it."""
    from torchtitan.config import ConfigManager

    from fastspec.integrations.torchtitan import FastspecTrainer

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    config = ConfigManager().parse_args(["--module", "examples.torchtitan_llama3", "--config",
                                         "llama3_debugmodel_fastspec", "--fastspec.emit_every", "20"])
    assert isinstance(config, FastspecTrainer.Config) and config.fastspec.enable
    assert config.fastspec.emit_every == 20 and config.model_spec.name == "llama3"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_an_untested_torchtitan_version_warns_once():
    res = _python(
        "import warnings, torchtitan\n"
        "torchtitan.__version__ = '0.9.1'\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import fastspec.integrations.torchtitan\n"
        "    import fastspec.integrations.torchtitan\n"
        "print([str(x.message) for x in w if 'torchtitan' in str(x.message)])\n")
    assert res.returncode == 0, res.stderr
    found = eval(res.stdout.strip().splitlines()[-1])
    assert found == ["fastspec.integrations.torchtitan: tested with torchtitan 0.3.x, found 0.9.1"]


def test_the_tested_version_does_not_warn():
    import torchtitan

    from fastspec.integrations import torchtitan as integration

    assert torchtitan.__version__.startswith("0.3.")
    with pytest.warns(UserWarning, match="found 0.4.0"):
        integration._check_version("0.4.0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration._check_version(torchtitan.__version__)


def test_fastspec_integrations_do_not_import_torchtitan():
    res = _python("import fastspec, fastspec.integrations, sys; "
                  "assert 'torchtitan' not in sys.modules, 'torchtitan imported'")
    assert res.returncode == 0, res.stderr
