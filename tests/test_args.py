"""One argument checker (fastspec/_args.py): its rules, and that Probe, Covariance and the other
public entry points give the same answer for the same kind of argument (NumPy bools and ints
included) and the same error, from that one module; precision/backend checked once, in
``UpdateSettings``, and handed down as that object."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiny_models import batch, build

import fastspec
from fastspec import _args
from fastspec.covariance.policy import BACKENDS, PRECISIONS, UpdateSettings

BAD_FLAGS = (1, 0, "yes", None, 1.0, np.int64(1))
BAD_INTS = (True, np.True_, 2.0, np.float64(2.0), "2", None)


def _error(fn, *args, **kwargs):
    """``(type, message)`` of what ``fn(*args, **kwargs)`` raises, or None if it returns."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


def _renamed(error, name: str):
    """``error`` of ``_args`` checking an argument called ``x``, as it reads for ``name``."""
    return None if error is None else (error[0], error[1].replace("x:", f"{name}:", 1))


def test_rules():
    for ok in (True, False, np.True_, np.False_):
        assert _args.flag("f", ok) is bool(ok)
    for bad in BAD_FLAGS:
        with pytest.raises(_args.ArgumentTypeError, match=r"^f: expected True or False, got "):
            _args.flag("f", bad)
    for ok in (3, np.int64(3), np.int32(3), np.uint8(3)):
        got = _args.integer("n", ok, minimum=1)
        assert got == 3 and type(got) is int
    for bad in BAD_INTS:
        with pytest.raises(_args.ArgumentTypeError, match=r"^n: expected an int >= 1, got "):
            _args.integer("n", bad, minimum=1)
    with pytest.raises(ValueError, match=r"^n: expected an int >= 1, got 0$") as info:
        _args.integer("n", np.int64(0), minimum=1)
    assert not isinstance(info.value, TypeError)  # a value out of range is not a type error
    assert _args.integer("n", None, optional=True) is None
    assert _args.real("x", np.float32(0.5), "a fraction", lambda x: 0 < x < 1) == 0.5
    for bad, err in ((True, TypeError), ("0.5", TypeError), (float("nan"), ValueError), (1.0, ValueError)):
        with pytest.raises(err, match=r"^x: expected a fraction, got "):
            _args.real("x", bad, "a fraction", lambda x: 0 < x < 1)
    assert _args.choice("c", "b", ("a", "b")) == "b"
    for bad in ("z", None, np.array(["a", "b"])):
        with pytest.raises(ValueError, match=r"^c: expected one of \('a', 'b'\), got "):
            _args.choice("c", bad, ("a", "b"))
    with pytest.raises(TypeError, match="^s: expected a non-empty str, got 3$"):
        _args.text("s", 3)
    # a wrong type is both: code that caught either before keeps working
    assert issubclass(_args.ArgumentTypeError, TypeError) and issubclass(_args.ArgumentTypeError, ValueError)


def test_probe_and_covariance_agree_on_flags_and_ints():
    model = build("gpt2")
    for value in (True, False, np.True_, np.False_, *BAD_FLAGS):
        want = _error(_args.flag, "x", value)
        assert _error(fastspec.Covariance, 4, track_mean=value) == _renamed(want, "track_mean")
        assert _error(fastspec.Probe, model, ffn=False, reset=value) == _renamed(want, "reset")
    cov = fastspec.Covariance(4)
    for value in (2, np.int64(2), np.int32(2), 0, np.int64(0), *BAD_INTS):
        want = _error(_args.integer, "x", value, minimum=1)
        assert _error(cov.update, torch.randn(2, 6, 4), row_step=value) == _renamed(want, "row_step")
        assert _error(fastspec.Probe, model, ffn=False, every=value) == _renamed(want, "every")
    assert fastspec.Probe(model, ffn=False, every=np.int64(3), reset=np.False_).every == 3


def test_other_entry_points_use_the_same_rules():
    from fastspec.integrations.alerts import RankCollapseAlert

    model = build("gpt2")
    assert RankCollapseAlert(repeat=np.True_).repeat is True
    assert fastspec.probe.ModuleSite("transformer.h.*.mlp.act", heads=np.int64(2)).heads == 2
    assert fastspec.metrics.normalized_rank(1.0, np.int64(1)).item() == 0.0
    assert fastspec.metrics.top_share(torch.ones(4), np.int64(2)).item() == 0.5
    assert fastspec.Probe(model, ffn=False, tp_rank=np.int64(1)).measure(batch(), step=0)
    covariance = fastspec.Covariance(4).update(torch.randn(3, 4)).covariance
    for call, name in ((lambda v: RankCollapseAlert(repeat=v), "repeat"),
                       (lambda v: covariance(unbiased=v), "unbiased"),
                       (lambda v: fastspec.Probe(model, ffn=False, cuda_graphs=v), "cuda_graphs")):
        assert _error(call, 1) == (_args.ArgumentTypeError, f"{name}: expected True or False, got 1")
    for call, name, minimum in ((lambda v: fastspec.probe.ModuleSite("x", heads=v), "modules: heads", 1),
                                (lambda v: fastspec.metrics.normalized_rank(1.0, v), "D", 1),
                                (lambda v: fastspec.Probe(model, ffn=False, tp_rank=v), "tp_rank", 0)):
        for bad in (True, 2.0, minimum - 1):
            want = _error(_args.integer, name, bad, minimum=minimum, optional=name == "modules: heads")
            assert want is not None and _error(call, bad) == want


def test_precision_and_backend_are_checked_once_and_handed_down_as_one_object():
    model = build("llama")
    for kw in ({"precision": "double"}, {"backend": "cuda"}, {"precision": None}):
        want = _error(UpdateSettings, **kw)
        assert want is not None and want[0] is ValueError
        assert _error(fastspec.Covariance, 4, **kw) == want
        assert _error(fastspec.Probe, model, **kw) == want
    assert {(s.precision, s.backend) for s in (UpdateSettings(p, b) for p in PRECISIONS for b in BACKENDS)} \
        == {(p, b) for p in PRECISIONS for b in BACKENDS}
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, precision="fast", backend="torch", forwards="all")
    assert (probe.precision, probe.backend) == ("fast", "torch")
    with probe.streaming():
        model(**batch())
    accs = list(probe._totals.accs.values())
    assert accs and all(acc.cov.settings is probe.settings for acc in accs)  # the same object, not copies
    probe.load_state_dict(probe.state_dict())
    assert all(acc.cov.settings is probe.settings for acc in probe._totals.accs.values())
    cov = fastspec.Covariance(4, settings=probe.settings)
    assert (cov.precision, cov.backend) == ("fast", "torch") and cov.settings is probe.settings
    with pytest.raises(ValueError, match=r"^precision, backend: given as settings="):
        fastspec.Covariance(4, settings=probe.settings, precision="exact")
    with pytest.raises(TypeError, match="^settings: expected a fastspec.covariance.policy.UpdateSettings"):
        fastspec.Covariance(4, settings=("fast", "torch"))
