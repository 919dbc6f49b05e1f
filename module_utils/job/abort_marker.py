"""The attempt's ABORT marker (`attempt-<N>/ABORT`, docs/contracts.md): how one node tells every other that the run is
over. Made by a hard link that never replaces a name, so the first writer's root cause wins."""

from __future__ import annotations

import json
import os
import uuid
from typing import Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import ABORT_MARKER, abort_marker_path
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_file

__all__ = ["ABORT_MARKER", "read_abort_marker", "write_abort_marker"]


def write_abort_marker(attempt_dir: str, rank: int, node: str, reason: str, kind: Optional[str] = None) -> bool:
    """Create the attempt's ABORT marker (a temp file hard-linked into place: link(2) never replaces a name, on NFS
    too); False when another rank's marker was there first (it stands)."""
    marker_path = abort_marker_path(attempt_dir)
    temp_path = f"{marker_path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as marker:
            json.dump({"rank": rank, "node": node, "reason": reason, **({"kind": kind} if kind else {})}, marker)
        os.link(temp_path, marker_path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp_path)
    return True


def read_abort_marker(attempt_dir: str) -> Optional[Dict[str, object]]:
    """The attempt's ABORT marker as a dict, or None when no rank failed; one that is unreadable, no JSON or no
    JSON object (a hand-made one) still counts as one."""
    try:
        text = read_file(abort_marker_path(attempt_dir)).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except OSError as err:
        # A marker we cannot read (a planted symlink: ELOOP) still means the attempt is not healthy.
        return {"rank": None, "node": None, "reason": f"unreadable ABORT marker: {err.strerror}"}
    try:
        marker = json.loads(text)
    except ValueError:
        return {"rank": None, "node": None, "reason": f"ABORT marker is no JSON: {text[:200]!r}"}
    # Not ours (a hand-made marker): it still stops the run, its content is the reason.
    return marker if isinstance(marker, dict) else {"rank": None, "node": None, "reason": str(marker)}
