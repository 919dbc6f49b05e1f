"""The job's ABORT marker: how one node tells every other that the run is over, through the shared results directory.

`<results_dir>/<job_id>/ABORT` holds JSON `{"rank", "node", "reason"}` for the rank that failed first. It is
created with O_EXCL, so the first writer wins and later failures (often consequences of the first) do not
overwrite the root cause. The running stage's nodes stop their containers when it appears; workers waiting for a
rank 0 that could not open the barrier stop at it too. The preparation stage removes a stale one.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

ABORT_MARKER = "ABORT"


def write_abort_marker(job_dir: str, rank: int, node: str, reason: str) -> bool:
    """Create the job's ABORT marker; False when another rank's marker was there first (it stands)."""
    path = os.path.join(job_dir, ABORT_MARKER)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as marker:
        json.dump({"rank": rank, "node": node, "reason": reason}, marker)
    return True


def read_abort_marker(job_dir: str) -> Optional[Dict[str, object]]:
    """The job's ABORT marker, or None when no rank failed; a marker caught mid-write still counts as one."""
    try:
        with open(os.path.join(job_dir, ABORT_MARKER), encoding="utf-8") as marker:
            text = marker.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"rank": None, "node": None, "reason": "(abort marker still being written)"}
