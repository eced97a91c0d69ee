"""``fastspec analyze``: the spectra of pretrained models and of series of checkpoints.

What researchers measure post hoc (the rank that holds 90% of the keys' variance per layer and
head, before and after RoPE; FFN utilisation by depth; how both move over a run's checkpoints),
in one call that loads each model, feeds it the same tokens, probes it with :class:`fastspec.Probe`
(the eval protocol) and writes records, spectra, a report and plots (docs/analyze.md)::

    fastspec.analyze("runs/my-run", "out/my-run", tokens=65536)   # or: fastspec analyze runs/my-run --out ...

One module per job:

* ``sources.py``: which models a path names (a model folder, a ``.gguf`` file, a folder of
  checkpoints ordered by step) and their architectures;
* ``text.py``: the text (a file, a folder, the built-in corpus) packed into a fixed token budget;
* ``run.py``: the loop (load, tokenize, forward + probe, solve, write; resumable);
* ``report.py``: findings, tables and plots of an output folder (``fastspec report`` too).

Nothing heavy is imported here: the names load on first use.
"""
import importlib

_LAZY_NAMES = {"analyze": "run", "Analysis": "run", "Settings": "run", "SITES": "run",
               "find_models": "sources", "ModelSource": "sources", "write_report": "report"}


def __getattr__(name: str):
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY_NAMES)
