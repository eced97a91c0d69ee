"""Benchmarks of fastspec against the torch.linalg code it replaces (``fastspec bench``/``compare``).

Results go to ``benchmarks/results/*.json``. Outside the package, next to the ``bench_*.py``
files: the pytest-benchmark glue (``benchmarks/conftest.py``, it needs pytest) and the developer
tools (``benchmarks/readme_table.py``, the README table from the results, on request only;
``benchmarks/sass.py``, SASS loops and registers of a cubin). The commands themselves are
:mod:`fastspec.commands.bench` and :mod:`fastspec.commands.compare`.

Layout, bottom to top; a module imports only from the lines above it (``tests/
test_bench_structure.py`` checks that the package has no import cycle):

* :mod:`~fastspec.bench.case` (the :class:`~fastspec.bench.case.Case` type, the
  :class:`~fastspec.bench.case.Claim` of accuracy each case carries, tiers, case selection,
  error and memory helpers), :mod:`~fastspec.bench.timing`, :mod:`~fastspec.bench.anchors`
  (external eigensolvers), :mod:`~fastspec.bench.cubin` (CUDA binary tools, SASS listings);
* :mod:`~fastspec.bench.models` (Llama-style models, the hand key-rank protocol, the training
  step case), :mod:`~fastspec.bench.runner` (runs cases into result rows);
* the suites, one module each in :mod:`fastspec.bench.suites` (``eigvalsh``, ``covariance``,
  ``keyrank``, ``train_step`` with ``train_step_compiled``, ``probe``), and the registry above
  them, ``fastspec.bench.suites.cases(suite, tier, device)``; :mod:`~fastspec.bench.accuracy`
  (``fastspec compare``, on the matrix families of :mod:`fastspec.eig.matrices`);
* :mod:`~fastspec.bench.table` (the terminal tables and verdict lines of both commands).
"""
