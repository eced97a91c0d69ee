"""Capture routing (fastspec/probe/routing.py): where a capture goes is computed from the
probe's state at capture time, one owner per fact, no switched-in target."""
from __future__ import annotations

import torch
from _tiny_models import batch, build

import fastspec
from fastspec.covariance.policy import UpdateSettings
from fastspec.probe.hooks import ForwardScope
from fastspec.probe.routing import Router
from fastspec.probe.sites import Collector
from fastspec.probe.timer import WorkTimer

TORCH = UpdateSettings(backend="torch")


def _router() -> tuple[Router, ForwardScope, Collector]:
    scope = ForwardScope(torch.nn.Identity())
    stream = Collector(TORCH)
    return Router(stream, scope, WorkTimer(None), row_step=1), scope, stream


def test_destination_follows_forward_measurement_and_schedule():
    router, scope, stream = _router()
    eval_ = Collector(TORCH)
    table = []
    for streaming in (False, True):
        for due in (False, True):
            router.streaming, router.capture_this_step = streaming, due
            for in_forward in (False, True):
                scope.depth = int(in_forward)
                plain = router.destination()
                with router.measuring(eval_):
                    measuring = router.destination()
                table.append((streaming, due, in_forward, plain, measuring))
    for streaming, due, in_forward, plain, measuring in table:
        assert plain is (stream if in_forward and streaming and due else None)
        assert measuring is (eval_ if in_forward else None)  # a measurement wins inside the forward
    assert router.destination() is stream  # the context restored nothing it did not own


def test_measuring_nests_and_restores_on_error():
    router, scope, stream = _router()
    scope.depth = 1
    a, b = Collector(TORCH), Collector(TORCH)
    try:
        with router.measuring(a):
            with router.measuring(b):
                assert router.destination() is b
            assert router.destination() is a
            raise RuntimeError("forward failed")
    except RuntimeError:
        pass
    assert router.destination() is None  # not streaming


def test_captures_outside_the_forward_and_on_idle_steps_are_dropped():
    router, scope, stream = _router()
    x = torch.randn(2, 5, 3, 4)
    router.streaming = True
    router.capture(router.slot("keys", 0), x, headed=True, convention="sv")  # depth 0: e.g. a checkpoint recompute
    assert stream.accs == {}
    scope.depth = 1
    router.capture_this_step = False
    router.capture(router.slot("keys", 0), x, headed=True, convention="sv")
    assert stream.accs == {}
    router.capture_this_step = True
    router.capture(router.slot("keys", 0), x, headed=True, convention="sv")
    assert stream.accs[("keys", 0)].cov.n.tolist() == [10, 10, 10]


def test_measure_while_streaming_leaves_the_stream_alone():
    model = build("llama")
    inputs = batch(B=2, T=6)
    probe = fastspec.Probe(model, ffn=False, emit_every=1000)
    with probe.streaming():
        model(**inputs)
        before = {k: acc.cov.n.clone() for k, acc in probe._totals.accs.items()}
        probe.measure(batch(B=3, T=6), step=0)
        assert {k: acc.cov.n for k, acc in probe._totals.accs.items()}.keys() == before.keys()
        for k, acc in probe._totals.accs.items():
            assert torch.equal(acc.cov.n, before[k])
        model(**inputs)  # streaming goes on after the measurement
    for k, acc in probe._totals.accs.items():
        assert torch.equal(acc.cov.n, 2 * before[k])
