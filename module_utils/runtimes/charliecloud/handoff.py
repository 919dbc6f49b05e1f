"""Rank 0's Charliecloud image handed to every node in one round, in both pipeline modes: rank 0 checks the committed
squashfs, announces it in the attempt's dir and makes itself ready; each worker waits for that announcement, finds
the entry in its own (checked) view of the cache and makes itself ready, in place or by unpacking once."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    AnnouncementError,
    wait_for_announcement,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    cache_operation,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.handoff import Rank0
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import write_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import Heartbeat, beating
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import (
    committed_squashfs,
    make_ready,
)


@cache_operation
def publish_and_ready(
    cache: CacheDirectory, image_id: str, unpack_dir: str, rank0: Optional[Rank0] = None, mountable=None
) -> Dict[str, Any]:
    """Rank 0: the committed squashfs `image_id` announced (with `rank0`) and this node made ready. A failure leaves the
    ABORT marker, so that no worker waits for an announcement that will not come."""
    beat = rank0.heartbeat_file if rank0 and rank0.heartbeat == "module" and rank0.heartbeat_stale else None
    with beating(beat):
        try:
            squashfs = committed_squashfs(cache, image_id)
            if rank0 is not None:
                write_announcement(rank0.attempt_dir, squashfs, image_id)
        except Exception as error:
            if rank0 is not None:
                write_abort_marker(rank0.attempt_dir, 0, rank0.node, f"rank 0 could not hand on {image_id}: {error}")
            raise
        announced = time.time()
    ready = make_ready(squashfs, image_id, unpack_dir, mountable)
    return dict(ready, squashfs=squashfs, announced=announced)


@cache_operation
def receive_and_ready(
    cache: CacheDirectory, rank0: Rank0, unpack_dir: str, marker_wait: float, mountable=None
) -> Dict[str, Any]:
    """A worker: rank 0's announcement waited for, then the entry it names made ready here. The entry is looked up by
    its digest in this node's checked cache dir, never at a path the announcement names."""
    heartbeat = Heartbeat(rank0.heartbeat_file, rank0.heartbeat_stale) if rank0.heartbeat_stale else None
    announcement = wait_for_announcement(
        rank0.attempt_dir, rank0_heartbeat=heartbeat, rank0=f"rank 0 ({rank0.node})", heartbeat=rank0.heartbeat
    )
    image_id = announcement["image_id"]
    squashfs = committed_squashfs(cache, image_id, marker_wait)
    started = time.time()
    ready = make_ready(squashfs, image_id, unpack_dir, mountable)
    return dict(ready, squashfs=squashfs, rank0_image_id=image_id, started=started)


__all__ = ["AnnouncementError", "publish_and_ready", "receive_and_ready"]
