"""Reproducible performance measurements (their figures and how to run each: benchmarks/README.md).

Every benchmark is run from the repository's root as a module: ``.venv/bin/python -m benchmarks.<name> [options]``.
"""
