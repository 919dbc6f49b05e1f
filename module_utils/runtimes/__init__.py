"""The container runtimes behind one seam (ARCHITECTURE.md, "Container runtimes: one seam"): stages receive a runtime
chosen by the `container_runtime` setting and never import a runtime themselves."""

from __future__ import annotations

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

RUNTIMES = ("docker", "charliecloud")
DEFAULT_RUNTIME = "docker"


class UnknownRuntimeError(UserError):
    """A `container_runtime` no runtime answers to."""


def check_runtime_name(name) -> str:
    """`name` when it names a runtime (None or "" is the default); else UnknownRuntimeError naming the choices."""
    chosen = DEFAULT_RUNTIME if name in (None, "") else str(name).strip().lower()
    if chosen not in RUNTIMES:
        raise UnknownRuntimeError(
            f"container_runtime {name!r} is not a runtime slurm-multi knows: choose one of {', '.join(RUNTIMES)} "
            "(-e container_runtime=charliecloud, or the site or user settings file)"
        )
    return chosen
