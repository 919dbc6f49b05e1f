"""A node's preflight for the job's container runtime: module_utils/node/preflight.py's checks, with the `docker`
check meaning the runtime's own. Under Charliecloud, Docker's checks (the daemon, its disk, stale GPU containers) give
way to charliecloud's (ch-run, user namespaces, squashfs in place or unpack, its disk, the shared cache).

    python3 -m ...module_utils.runtimes.preflight --json '<settings, with container_runtime>'
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import check_runtime_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.checks import (
    charliecloud_checks,
)

# Docker's own checks, which mean nothing where no daemon runs (the runtime's check takes `docker`'s place).
DOCKER_ONLY = ("docker", "disk", "stale_gpu_containers")


def runtime_preflight(settings: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """`preflight.node_preflight` under `settings["container_runtime"]`; a charliecloud result also says
    `image_access` (in-place or unpack) for this node."""
    runtime = check_runtime_name(settings.get("container_runtime"))
    if runtime == "docker":
        return preflight.node_preflight(settings, environ)
    checks = list(preflight.CHECKS if settings.get("checks") is None else settings["checks"])
    unknown = set(checks) - set(preflight.CHECKS)
    if unknown:
        raise ValueError(f"unknown preflight checks {sorted(unknown)}; known: {', '.join(preflight.CHECKS)}")
    result = preflight.node_preflight(dict(settings, checks=[c for c in checks if c not in DOCKER_ONLY]), environ)
    if "docker" in checks or "disk" in checks:
        node = result["node"]
        wanted = dict(settings) if "disk" in checks else dict(settings, image_bytes=0, disk_headroom_gb=0)
        problems, notes, access = charliecloud_checks(node, wanted, builds=bool(settings.get("builds")))
        result["problems"] += problems
        result["notes"] += notes
        result["image_access"] = access
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(preflight.main(sys.argv[1:], runtime_preflight))
