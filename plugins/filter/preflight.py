"""Filter of the preflight stage (roles/preflight): which shared dirs each node must read the job's nonce from (the
preflight_nonce module writes it); the logic is module_utils/node/preflight.py's."""

import os

from ansible.errors import AnsibleFilterError

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    ImageCacheError,
    check_cache_dir,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight


def preflight_shared_dirs(results_dir, job_id, attempt, image_cache_dir):
    """The dirs every node must share, ``[{name, path, nonce_file}]``: results_dir (the nonce in the attempt dir)
    and image_cache_dir (one nonce file per attempt: jobs share the cache) when it exists. MAD_DOCKER_BUILDS
    overrides the cache dir on the nodes, so a run that sets it is checked where the nodes look."""
    try:
        attempt_dir = job_layout.attempt_dir(str(results_dir), str(job_id), attempt)
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None
    dirs = [
        {"name": "results_dir", "path": str(results_dir), "nonce_file": os.path.join(attempt_dir, preflight.NONCE_FILE)}
    ]
    if image_cache_dir or os.environ.get("MAD_DOCKER_BUILDS"):
        cache = resolve_cache_dir(str(image_cache_dir or ""))
        try:
            # A cache dir not made yet is the build stage's to create; one others could write is refused now,
            # before the nonce (or anything) is written into it.
            if not check_cache_dir(cache, create=False):
                return dirs
        except ImageCacheError as exc:
            raise AnsibleFilterError(str(exc)) from None
        nonce_file = preflight.image_cache_nonce_file(cache, str(job_id), attempt)
        dirs.append({"name": "image_cache_dir", "path": cache, "nonce_file": nonce_file})
    return dirs


class FilterModule:
    def filters(self):
        return {"preflight_shared_dirs": preflight_shared_dirs}
