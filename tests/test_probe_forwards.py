"""Which forwards streaming captures: training forwards only (the probed model in training mode
with gradients enabled), so that a trainer's evaluation never mixes held-out tokens into the
training statistics nor counts as step time; ``forwards="all"`` keeps every forward. Plain loops,
the trainers' own evaluation paths (Hugging Face ``Trainer`` with ``eval_steps``, Lightning's
``validation_step``), and a compiled model (no graph break, no recompile per step)."""
from __future__ import annotations

import math

import pytest
import torch
from _tiny_models import batch, build, demo_model

import fastspec


def _values(records) -> dict:
    """Every streamed statistic by (step, site, layer, head, metric); the overhead record is a timing."""
    return {(r.step, r.site, r.layer, r.head_index, r.metric): r.value for r in records
            if r.site != "probe" and r.protocol == "stream"}


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got and got.keys() == want.keys()
    bad = [k for k in want if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))]
    assert not bad, f"{len(bad)} of {len(want)} records differ, e.g. {[(k, got[k], want[k]) for k in bad[:3]]}"


def _n(values: dict, site: str = "keys") -> set:
    return {v for (_, s, _, _, m), v in values.items() if s == site and m == "n"}


def _evaluate(model, inputs: dict) -> None:
    """Forwards that do not train, each in its own way: eval mode under no_grad (what trainers
    do), inference mode and no_grad in training mode, and eval mode with gradients on."""
    model.eval()
    with torch.no_grad():
        model(**inputs)
    model(**inputs)  # eval mode, gradients on: not a training forward either
    model.train()
    with torch.inference_mode():
        model(**inputs)
    with torch.no_grad():
        model(**inputs)


def _train_loop(evaluate: bool, forwards: str = "train", steps: int = 3) -> dict:
    model = build("llama").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = fastspec.Probe(model, queries=True, prerope_keys=True, ffn_rows="all", emit_every=1, forwards=forwards)
    train, held_out = batch(B=2, T=8, seed=1), batch(B=3, T=5, seed=2)
    with probe.streaming():
        for step in range(steps):
            model(**train, labels=train["input_ids"]).loss.backward()
            opt.step()
            opt.zero_grad()
            if evaluate:
                _evaluate(model, held_out)
            probe.step(step)
    return _values(probe.records())


def test_evaluation_forwards_between_steps_leave_the_streamed_records_bitwise_unchanged():
    plain, evaluated = _train_loop(evaluate=False), _train_loop(evaluate=True)
    _assert_bitwise(evaluated, plain)
    assert _n(plain) == _n(plain, "ffn") == {16.0}  # each step's 2 x 8 training tokens, nothing else


def test_forwards_all_streams_every_forward_as_before():
    plain, evaluated = _train_loop(evaluate=False, forwards="all"), _train_loop(evaluate=True, forwards="all")
    assert _n(plain) == {16.0}
    assert _n(evaluated) == {16.0 + 4 * 15.0}  # the 4 evaluation forwards of 3 x 5 tokens too
    with pytest.raises(ValueError, match="forwards"):
        fastspec.Probe(build("llama"), forwards="eval")


def test_an_evaluation_forward_costs_no_step_time_and_is_reported():
    now = [0.0]
    model = build("gpt2").train()
    probe = fastspec.Probe(model, ffn=False, emit_every=1000, clock=lambda: now[0])
    inputs = batch(B=2, T=8)

    def slow_when_evaluating(module, args):
        if not torch.is_grad_enabled():
            now[0] += 10.0  # an evaluation forward takes 10 s
    model.transformer.h[0].register_forward_pre_hook(slow_when_evaluating)
    with probe.streaming():
        for step in range(4):
            model(**inputs)
            now[0] += 1.0  # the step's own work
            model.eval()
            with torch.no_grad():
                model(**inputs)
            model.train()
            probe.step(step)
    ov = probe.overhead()
    assert ov["base_s"] == pytest.approx(3 * 1.0)  # every step but the first has a start
    assert (ov["other_forwards"], ov["other_s"]) == (4, pytest.approx(40.0))
    assert ov["paused_steps"] == 0  # left out before the pause rule saw it
    # forwards="all": they are captured and are step time, as before
    now[0] = 0.0
    probe = fastspec.Probe(model, ffn=False, emit_every=1000, clock=lambda: now[0], forwards="all")
    with probe.streaming():
        for step in range(4):
            now[0] += 1.0
            with torch.no_grad():
                model(**inputs)
            probe.step(step)
    assert probe.overhead()["base_s"] == pytest.approx(3 * 11.0) and probe.overhead()["other_forwards"] == 0


def test_streaming_only_evaluation_forwards_warns_with_the_reason():
    model = build("llama")  # eval mode
    probe = fastspec.Probe(model, ffn=False, emit_every=1)
    with probe.streaming():
        with torch.no_grad():
            model(**batch())
        with pytest.warns(UserWarning, match=r"the 1 forward\(s\) it saw did not train .*forwards='all'"):
            probe.step(0)
    assert not _n(_values(probe.records()))  # nothing captured


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def test_compiled_streaming_of_only_evaluation_forwards_warns_with_the_eager_reason(_fresh_dynamo):
    """A compiled model whose forwards all run under no_grad: the warning gives the reason the
    eager path gives (no training forward), not the attention-interface hint; a compiled
    training forward seen in the same window silences it, and the hint costs no graph break."""
    model = build("llama")
    probe = fastspec.Probe(model, ffn=False, emit_every=1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with probe.streaming():
        with torch.no_grad():
            compiled(**batch())
        with pytest.warns(UserWarning, match=r"the compiled forward\(s\) it saw did not train .*forwards='all'"):
            probe.step(0)
    assert not _n(_values(probe.records()))
    model.train()
    probe = fastspec.Probe(model, ffn=False, emit_every=1)
    with probe.streaming():
        with torch.no_grad():
            compiled(**batch())
        compiled(**batch())  # trains: the keys are captured, nothing to warn about
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            probe.step(0)
    assert _n(_values(probe.records()))


def _compiled_loop(evaluate: bool, steps: int = 4) -> dict:
    torch._dynamo.reset()
    model = build("llama").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    train, held_out = batch(B=2, T=8, seed=1), batch(B=2, T=8, seed=2)
    with probe.streaming():
        for step in range(steps):
            compiled(**train, labels=train["input_ids"]).loss.backward()
            opt.step()
            opt.zero_grad()
            if evaluate:
                model.eval()
                with torch.no_grad():
                    compiled(**held_out)
                model.train()
            if step == 0:  # a graph per mode was traced: from here on a recompile raises
                torch.compiler.set_stance("fail_on_recompile")
            probe.step(step)
    torch.compiler.set_stance("default")
    return _values(probe.records())


def test_compiled_evaluation_forwards_are_not_captured_and_never_recompile(_fresh_dynamo):
    plain, evaluated = _compiled_loop(evaluate=False), _compiled_loop(evaluate=True)
    _assert_bitwise(evaluated, plain)
    assert _n(plain) == {32.0}  # two training steps of 2 x 8 tokens per emission


def _hf_trainer_run(tmp_path, evaluate: bool) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Stream(TrainerCallback):  # a user's streaming probe: one step() per optimizer step
        def __init__(self, probe):
            self.probe = probe

        def on_train_begin(self, args, state, control, **kwargs):
            self.probe.attach()

        def on_step_end(self, args, state, control, **kwargs):
            self.probe.step(int(state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            self.probe.detach()

    model = demo_model().train()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16), generator=g)]
    held_out = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 16), generator=g)]
    probe = fastspec.Probe(model, emit_every=1)
    args = TrainingArguments(output_dir=str(tmp_path / f"eval{evaluate}"), max_steps=4, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_steps=100, disable_tqdm=True, seed=0,
                             eval_strategy="steps" if evaluate else "no", eval_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=held_out if evaluate else None,
                      callbacks=[Stream(probe)])
    trainer.train()
    if evaluate:
        assert sum("eval_loss" in h for h in trainer.state.log_history) == 4  # it did evaluate, every step
    return _values(probe.records())


def test_hf_trainer_evaluation_every_step_leaves_streaming_unchanged(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    plain, evaluated = _hf_trainer_run(tmp_path, False), _hf_trainer_run(tmp_path, True)
    _assert_bitwise(evaluated, plain)
    assert _n(plain) == {32.0}


def _lightning_run(tmp_path, validate: bool) -> dict:
    pl = pytest.importorskip("lightning.pytorch")

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = demo_model().train()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stream(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.probe = fastspec.Probe(pl_module.model, emit_every=1)
            self.probe.attach()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.probe.step(int(trainer.global_step))

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    train, held_out = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    loader = torch.utils.data.DataLoader(train, batch_size=2)
    stream = Stream()
    trainer = pl.Trainer(max_steps=4, logger=False, callbacks=[stream], accelerator="cpu", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         val_check_interval=1, num_sanity_val_steps=2 if validate else 0,
                         limit_val_batches=2 if validate else 0)
    lm = LM()
    if validate:
        trainer.fit(lm, loader, torch.utils.data.DataLoader(held_out, batch_size=2))
        assert trainer.callback_metrics.get("val_loss") is not None  # it did validate
    else:
        trainer.fit(lm, loader)
    stream.probe.detach()
    return _values(stream.probe.records())


def test_lightning_validation_steps_leave_streaming_unchanged(tmp_path):
    plain, validated = _lightning_run(tmp_path, False), _lightning_run(tmp_path, True)
    _assert_bitwise(validated, plain)
    assert _n(plain) == {32.0}
