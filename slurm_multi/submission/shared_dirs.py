"""The shared dirs a job will write, checked on the submit host before anything is written or queued.

The results dir (with its ``records/``) and the image cache must exist or be creatable, writable by you, be yours or
root's, and none writable by others without the sticky bit: in a team's dir without it a teammate could plant an
ABORT marker, records or perf.csv of their own. The nodes check the same again in their preflight stage.
"""

import os
import pwd

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    ImageCacheError,
    check_cache_dir,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import default_image_cache_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import read_settings
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import JobSpec


def check_shared_dirs(spec: JobSpec) -> None:
    """Refuse the job's results dir, records dir or image cache dir when others could plant files there
    (SlurmMultiError naming the dir and the fix); nothing is created."""
    try:
        results_dir_trust.check_results_dir(str(spec.results_dir))
        _check_writable(str(spec.results_dir), "results directory", "results_dir (--results-dir)")
        if not spec.registry:  # registry mode has no image cache
            cache = image_cache_dir(spec)
            check_cache_dir(cache, create=False)
            _check_writable(cache, "image cache directory", "image_cache_dir (-e image_cache_dir=DIR)")
    except (JobLayoutError, ImageCacheError) as exc:
        raise SlurmMultiError(f"{exc}. Nothing was submitted") from None


def _check_writable(path: str, what: str, setting: str) -> None:
    """Refuse ``path`` unless it is a directory you may write, or can be made: its nearest existing parent is one."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    made = "" if existing == os.path.abspath(path) else f" cannot be made: its parent {existing}"
    if not os.path.isdir(existing):
        raise JobLayoutError(f"the {what} {path}{made} is not a directory: choose another {setting}")
    if not os.access(existing, os.W_OK | os.X_OK):
        user = pwd.getpwuid(os.geteuid()).pw_name
        raise JobLayoutError(
            f"the {what} {path}{made} is not writable by you ({user}): the job could write nothing there. "
            f"Choose a {setting} of your own on storage every node sees, or ask its owner for write access"
        )


def image_cache_dir(spec: JobSpec) -> str:
    """The image cache the nodes will use, as far as this host knows: $MAD_DOCKER_BUILDS (the job's environment
    reaches them), else -e's or the settings files' image_cache_dir, else the default in the results dir; ``%u``
    the user. (An inventory of the user's own may set another: the nodes' preflight checks that one.)"""
    given = spec.extra_vars.get("image_cache_dir") or read_settings().values.get("image_cache_dir")
    return resolve_cache_dir(str(given or default_image_cache_dir(str(spec.results_dir))))
