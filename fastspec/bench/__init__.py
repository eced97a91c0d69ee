"""Benchmarks of fastspec against the torch.linalg code it replaces (``fastspec bench``/``compare``).

Results go to ``benchmarks/results/*.json`` and the README table is generated from them, on
request only, by :mod:`fastspec.bench.table`. The pytest-benchmark glue is not part of the
package: it lives in ``benchmarks/conftest.py``, next to the ``bench_*.py`` files that use it.

Layout, bottom to top; a module imports only from the lines above it (``tests/
test_bench_structure.py`` checks that the package has no import cycle):

* :mod:`~fastspec.bench.case` (the :class:`~fastspec.bench.case.Case` type, tiers, error and
  memory helpers), :mod:`~fastspec.bench.timing`, :mod:`~fastspec.bench.anchors` (external
  eigensolvers);
* :mod:`~fastspec.bench.models` (Llama-style models, the hand key-rank protocol, the training
  step case), :mod:`~fastspec.bench.runner` (runs cases into result rows);
* the suites: :mod:`~fastspec.bench.cases_eigvalsh`, :mod:`~fastspec.bench.cases_covariance`,
  :mod:`~fastspec.bench.cases_models` (``keyrank``, ``train_step``,
  ``train_step_compiled``),
  :mod:`~fastspec.bench.cases_probe`; and :mod:`~fastspec.bench.accuracy` (``fastspec
  compare``, on the matrix families of :mod:`fastspec.eig.cases`);
* :mod:`~fastspec.bench.cases` (the registry: ``cases(suite, tier, device)``, ``SUITES``),
  :mod:`~fastspec.bench.table` (terminal and README tables);
* :mod:`~fastspec.bench.cli_common` (flags and output both commands share), then
  :mod:`~fastspec.bench.cli_compare` (``fastspec compare``) and :mod:`~fastspec.bench.cli`
  (``fastspec bench``, which hands ``--accuracy`` to ``cli_compare``).
"""
