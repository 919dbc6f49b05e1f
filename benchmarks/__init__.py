"""Reproducible performance measurements (their figures and how to run each: benchmarks/README.md).

Every benchmark is run from the repository's root as a module: ``.venv/bin/python -m benchmarks.<name> [options]``.

Importing this package first makes the project's module_utils/ importable as ``ansible.module_utils.<name>``: the
same seam the slurm_multi package uses (slurm_multi.paths.use_project_module_utils).
"""

from slurm_multi.paths import use_project_module_utils

# Done here, before any benchmark module is imported, so that each can import the node-side code it measures at its
# top, in one ordinary import block (importing slurm_multi does it too; the call says what this package relies on).
use_project_module_utils()
