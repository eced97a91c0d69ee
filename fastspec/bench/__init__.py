"""Benchmarks of fastspec against the torch.linalg code it replaces (``fastspec bench``/``compare``).

Case definitions live in :mod:`fastspec.bench.cases` and are shared by ``benchmarks/bench_*.py``
(pytest-benchmark) and the CLI; results go to ``benchmarks/results/*.json`` and the README table
is generated from them by :mod:`fastspec.bench.table`.
"""
