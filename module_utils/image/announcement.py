"""Rank 0's image, announced to the workers as ``<attempt dir>/image.json``: how pull mode hands the image on. A
worker's wait ends at once on the ABORT marker or when rank 0's heartbeat stands still; the barrier checks the IDs."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import read_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import Heartbeat
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_file, write_file_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

ANNOUNCEMENT_FILE = "image.json"
POLL_SECONDS = 0.2
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}\Z")
_REFERENCE = re.compile(r"[!-~]{1,512}\Z")  # printable ASCII without spaces, as Docker references are


class AnnouncementError(UserError):
    """No usable announcement: the wait was given up, timed out, or the file is not one rank 0 wrote.
    `aborted_by_rank`: the rank whose ABORT marker gave the run up (this node only stopped for it), else None."""

    def __init__(self, message: str, aborted_by_rank: Optional[int] = None):
        super().__init__(message)
        self.aborted_by_rank = aborted_by_rank


def announcement_path(attempt_dir: str) -> str:
    return os.path.join(attempt_dir, ANNOUNCEMENT_FILE)


def _checked(reference: object, image_id: object, where: str) -> Dict[str, str]:
    if not isinstance(image_id, str) or not _IMAGE_ID.match(image_id):
        raise AnnouncementError(f"{where}: image_id {str(image_id)[:80]!r} is not an image ID (sha256:<64 hex>)")
    if not isinstance(reference, str) or not _REFERENCE.match(reference):
        raise AnnouncementError(f"{where}: reference {str(reference)[:80]!r} is not an image reference")
    return {"reference": reference, "image_id": image_id}


def write_announcement(attempt_dir: str, reference: str, image_id: str) -> Dict[str, str]:
    """Announce rank 0's image in ``attempt_dir`` (atomically: a reader sees the whole file or none)."""
    announcement = _checked(reference, image_id, "rank 0's image")
    write_file_atomically(announcement_path(attempt_dir), json.dumps(announcement).encode("utf-8"))
    return announcement


def read_announcement(attempt_dir: str) -> Optional[Dict[str, str]]:
    """The announcement, or None while rank 0 has not written it."""
    path = announcement_path(attempt_dir)
    try:
        data = json.loads(read_file(path).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise AnnouncementError(f"{path} cannot be read as rank 0's announcement: {error}") from None
    if not isinstance(data, dict):
        raise AnnouncementError(f"{path} is not a JSON object")
    return _checked(data.get("reference"), data.get("image_id"), path)


def wait_for_announcement(
    attempt_dir: str,
    timeout: float = 0.0,
    poll: float = POLL_SECONDS,
    rank0_heartbeat: Optional[Heartbeat] = None,
    rank0: str = "rank 0",
    heartbeat: str = "playbook",
) -> Dict[str, str]:
    """Rank 0's announcement once it is there; AnnouncementError when the run is given up, rank 0's heartbeat
    stands still, or ``timeout`` (0: none) passes. ``heartbeat`` names what beats, for the error."""
    started = time.monotonic()
    while True:
        stopped = rank0_heartbeat.stopped() if rank0_heartbeat else None
        if stopped:
            raise AnnouncementError(
                f"{rank0}'s {heartbeat} {stopped} while this node waited for its image: it died (killed, or its node "
                f"lost) before it announced one. Its build may still be running there; the job's output says where "
                "it stopped"
            )
        marker = read_abort_marker(attempt_dir)
        if marker:
            raise AnnouncementError(
                f"the run was given up while this node waited for rank 0's image: rank {marker.get('rank')} "
                f"({marker.get('node')}) failed: {marker.get('reason')}",
                aborted_by_rank=marker.get("rank"),
            )
        announcement = read_announcement(attempt_dir)
        if announcement:
            announcement["waited_seconds"] = round(time.monotonic() - started, 3)
            return announcement
        if timeout and time.monotonic() - started >= timeout:
            raise AnnouncementError(
                f"rank 0 announced no image in {announcement_path(attempt_dir)} within {timeout:g} s: check rank "
                f"0's build stage (its run.log and the job's output), and that {attempt_dir} is on storage every "
                f"node sees"
            )
        time.sleep(poll)
