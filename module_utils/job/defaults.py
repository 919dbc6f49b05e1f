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

# The numeric settings whose default more than one layer needs: group_vars (the playbook), the modules' options
# (a module called directly), node selection (`submit --select-nodes`) and the checks' own fallbacks read these, so
# the same cluster gets the same check from each (tests/unit/test_pipeline_defaults.py holds them equal).
SETTING_DEFAULTS = {
    # Seconds a node's clock may differ from the controller's (or the shared filesystem's).
    "preflight_max_clock_skew": 10.0,
    # Free GB Docker's data root must keep on top of the image.
    "preflight_disk_headroom_gb": 5.0,
    # Committed image cache entries a prune keeps, however old.
    "image_cache_keep": 5,
    # Seconds the rank-0 barrier may take overall.
    "barrier_timeout": 600.0,
    # Seconds a node's heartbeat may stand still before the node is taken for dead (a shared filesystem shows
    # another node's change within ~3 s).
    "heartbeat_stale": 30.0,
}


def default_results_dir(environ=None) -> str:
    """``$SLURM_MULTI_RESULTS_DIR``, else ``$HOME/slurm-multi-results``, as an absolute path."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.abspath(environ.get(RESULTS_DIR_ENV) or os.path.join(home, RESULTS_DIR_IN_HOME))


def pipeline_default(name: str, environ=None):
    """The default of setting ``name``: results_dir, image_cache_dir, image_transport or one of SETTING_DEFAULTS."""
    if name == "results_dir":
        return default_results_dir(environ)
    defaults = {"image_cache_dir": IMAGE_CACHE_DIR, "image_transport": IMAGE_TRANSPORT, **SETTING_DEFAULTS}
    if name not in defaults:
        known = ", ".join(["results_dir", *defaults])
        raise KeyError(f"no pipeline default named {name!r}: {known}")
    return defaults[name]
