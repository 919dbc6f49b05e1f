"""The defaults both sides read, each written once: group_vars/all.yml (through the `pipeline_default` filter), the
CLI and job spec, the job script's submission and node selection.

Runs on the controller and the nodes alike (Python 3.8, standard library only).
"""

import os

# Where each job's results, records and perf.csv go: $SLURM_MULTI_RESULTS_DIR, else ~/slurm-multi-results (home
# directories are on shared storage on a SLURM cluster).
RESULTS_DIR_ENV = "SLURM_MULTI_RESULTS_DIR"
RESULTS_DIR_IN_HOME = "slurm-multi-results"

# The shared image tar cache; %u is the user's name (module_utils/image/cache/entries.py, `user_cache_dir`).
IMAGE_CACHE_DIR = "/tmp/slurm-multi-image-cache-%u"

# How rank 0's image reaches the workers without a registry given (README, "Running on a real cluster": the tar
# cache, registry mode, the streamed transport, and why the default is cache).
IMAGE_TRANSPORTS = ("cache", "stream", "registry")
IMAGE_TRANSPORT = "cache"


def default_results_dir(environ=None) -> str:
    """``$SLURM_MULTI_RESULTS_DIR``, else ``$HOME/slurm-multi-results``, as an absolute path."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.abspath(environ.get(RESULTS_DIR_ENV) or os.path.join(home, RESULTS_DIR_IN_HOME))


def pipeline_default(name: str, environ=None) -> str:
    """The default of setting ``name``: results_dir, image_cache_dir or image_transport."""
    if name == "results_dir":
        return default_results_dir(environ)
    defaults = {"image_cache_dir": IMAGE_CACHE_DIR, "image_transport": IMAGE_TRANSPORT}
    if name not in defaults:
        raise KeyError(f"no pipeline default named {name!r}: results_dir, image_cache_dir or image_transport")
    return defaults[name]
