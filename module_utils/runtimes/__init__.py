"""The container runtimes, one package each behind the run stage's seam (module_utils/run/container_runtime.py,
docs/runtimes.md): a new runtime is one new package here and its tests."""

from __future__ import annotations

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import ContainerRuntime
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.rank import (
    CharliecloudRuntime,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.docker.rank import DockerRuntime
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

RUNTIMES = {runtime.name: runtime for runtime in (DockerRuntime, CharliecloudRuntime)}
DEFAULT_RUNTIME = DockerRuntime.name


class UnknownRuntime(UserError):
    """A container_runtime no package here implements."""


def by_name(name: str) -> ContainerRuntime:
    """The runtime called ``name`` (the job's ``container_runtime``); UnknownRuntime naming the choices."""
    runtime = RUNTIMES.get(str(name or "").strip().lower())
    if runtime is None:
        raise UnknownRuntime(
            f"container_runtime {name!r} is not one slurm-multi knows: choose one of {', '.join(sorted(RUNTIMES))} "
            "(-e container_runtime=..., or the site's or your settings file)"
        )
    return runtime()
