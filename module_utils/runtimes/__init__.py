"""The container runtimes, one package each behind one seam (ARCHITECTURE.md, "Container runtimes: one seam"): the
stages receive a runtime chosen by the `container_runtime` setting and never import one themselves; a new runtime is
one new package here and its tests."""

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


def check_runtime_name(name) -> str:
    """``name`` when it names a runtime (None or "" is the default); else UnknownRuntime naming the choices."""
    chosen = DEFAULT_RUNTIME if name in (None, "") else str(name).strip().lower()
    if chosen not in RUNTIMES:
        raise UnknownRuntime(
            f"container_runtime {name!r} is not one slurm-multi knows: choose one of {', '.join(RUNTIMES)} "
            "(-e container_runtime=..., or the site's or your settings file)"
        )
    return chosen


def by_name(name) -> ContainerRuntime:
    """The runtime called ``name`` (the job's ``container_runtime``); UnknownRuntime naming the choices."""
    return RUNTIMES[check_runtime_name(name)]()
