"""A node's preflight for the job's container runtime: module_utils/node/preflight.py's checks, less the Docker ones
the runtime replaces (its `replaces_checks`), plus the runtime's own (its `node_checks`) in place of `docker` and
`disk`. Under Docker nothing is replaced.

    python3 -m ...module_utils.runtimes.preflight --json '<settings, with container_runtime>'
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import by_name

# The checks whose place a runtime's own checks take when it replaces them; `disk` also means its disk need.
RUNTIME_CHECK_PLACES = ("docker", "disk")


def runtime_preflight(settings: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """`preflight.node_preflight` under `settings["container_runtime"]`, with the fields the runtime's checks add
    (charliecloud: `image_access`, in-place or unpack, for this node)."""
    runtime = by_name(settings.get("container_runtime"))
    checks = list(preflight.CHECKS if settings.get("checks") is None else settings["checks"])
    unknown = set(checks) - set(preflight.CHECKS)
    if unknown:
        raise ValueError(f"unknown preflight checks {sorted(unknown)}; known: {', '.join(preflight.CHECKS)}")
    kept = [check for check in checks if check not in runtime.replaces_checks]
    result = preflight.node_preflight(dict(settings, checks=kept), environ)
    if any(check in runtime.replaces_checks for check in RUNTIME_CHECK_PLACES if check in checks):
        wanted = dict(settings) if "disk" in checks else dict(settings, image_bytes=0, disk_headroom_gb=0)
        problems, notes, fields = runtime.node_checks(result["node"], wanted, builds=bool(settings.get("builds")))
        result["problems"] += problems
        result["notes"] += notes
        result.update(fields)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(preflight.main(sys.argv[1:], runtime_preflight))
