"""The attempt's ABORT marker: how one node tells every other that the run is over, through the shared results dir.

`<results_dir>/<job_id>/attempt-<N>/ABORT` holds JSON `{"rank", "node", "reason"}` for the rank that failed first,
and `"kind": "hang"` when rank 0's watchdog called the run hung (module_utils/run/hang/watch.py): every node then
takes its ranks' stacks before it stops them.
It appears whole, by a hard link that never replaces a name (nor follows a symlink), so the first writer wins and
later failures (often consequences of the first) do not overwrite the root cause. The running stage's nodes stop
their containers when it appears; workers waiting for a rank 0 that could not open the barrier stop at it too. Each
attempt of a requeued job has its own directory, so an earlier attempt's marker never stops a later one.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import ABORT_MARKER, abort_marker_path
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_file

__all__ = ["ABORT_MARKER", "read_abort_marker", "write_abort_marker"]


def write_abort_marker(attempt_dir: str, rank: int, node: str, reason: str, kind: Optional[str] = None) -> bool:
    """Create the attempt's ABORT marker; False when another rank's marker was there first (it stands).

    The JSON is written to a temp file first and then hard-linked into place: link(2) never replaces a name (the
    first writer still wins, on NFS too) and the marker appears whole, so no reader ever sees it half-written and
    blames no rank.
    """
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
    """The attempt's ABORT marker as a dict, or None when no rank failed.

    The one reader of the marker (the run, the barrier and collect): a marker that is unreadable, no JSON or not a
    JSON object (a hand-made one) still counts as one.
    """
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
