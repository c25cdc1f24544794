"""Experiments: training runs compared with each other (``sara matrix``: every algorithm x allocator cell over seeds
at the same rollout budget), the statistics of their accuracy-vs-rollouts curves and their report.

Modules: ``matrix`` (cells, parallel runs), ``curves`` (measurements of one curve, intervals over seeds),
``matrix_report`` (``matrix.json``, ``matrix.md``, ``matrix.png``, ``matrix_seconds.png``, ``matrix_tokens.png``).
Benchmarks that do not train live in ``sara.bench``.
"""
