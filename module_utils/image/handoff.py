"""Rank 0's image handed to every node through the shared tar cache in one round, in both modes."""

from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    AnnouncementError,
    wait_for_announcement,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    CacheResult,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import (
    publish_image,
    teach_daemon,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import RebuildRecipe
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import write_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import nodes_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import HEARTBEATS, Heartbeat, beating


class Rank0:
    """Where rank 0 announces (the attempt dir) and how the workers see it alive."""

    def __init__(self, attempt_dir: str, node: str, heartbeat: str = "playbook", heartbeat_stale: float = 0.0):
        if heartbeat not in HEARTBEATS:
            raise ValueError(f"heartbeat must be one of {', '.join(HEARTBEATS)}, got {heartbeat!r}")
        self.attempt_dir = attempt_dir
        self.node = node
        self.heartbeat = heartbeat
        self.heartbeat_stale = heartbeat_stale

    @property
    def heartbeat_file(self) -> str:
        return os.path.join(nodes_dir(self.attempt_dir), self.node, HEARTBEATS[self.heartbeat])


def publish_and_announce(
    cache: CacheDirectory, image: str, rank0: Rank0, teach: bool = True
) -> Tuple[CacheResult, float]:
    """Rank 0: publish `image`, then announce its ID; (outcome, when it was announced). A failure leaves the ABORT
    marker. `teach`: then teach this daemon digests (cache/teach.py) while the workers load, never failing for it."""
    # Push mode: nothing else beats for rank 0 while it publishes (pull mode: its playbook does).
    beat = rank0.heartbeat_file if rank0.heartbeat == "module" and rank0.heartbeat_stale else None
    with beating(beat):
        try:
            outcome = publish_image(cache, image, teach=False)
            write_announcement(rank0.attempt_dir, image, outcome.image_id)
        except Exception as error:
            write_abort_marker(rank0.attempt_dir, 0, rank0.node, f"rank 0 could not publish {image}: {error}")
            raise
        announced = time.time()
        # Only after a whole save: an image the cache held already, or published layer by layer, has nothing to
        # teach, and asking the daemon costs a push on every warm job's rank 0.
        if teach and outcome.teachable:
            try:
                outcome.details.update(teach_daemon(cache, image))
            except Exception as error:  # noqa: BLE001 - a lesson that failed leaves the next publish a whole save
                outcome.details["not_taught"] = f"{type(error).__name__}: {error}"
    return outcome, announced


def load_announced(
    cache: CacheDirectory, image: str, rank0: Rank0, marker_wait: float, rebuild: Optional[RebuildRecipe] = None
) -> Tuple[CacheResult, Dict[str, str]]:
    """A worker: wait for rank 0's announcement of `image`, then load the image it names; (outcome, announcement)."""
    heartbeat = Heartbeat(rank0.heartbeat_file, rank0.heartbeat_stale) if rank0.heartbeat_stale else None
    announcement = wait_for_announcement(
        rank0.attempt_dir, rank0_heartbeat=heartbeat, rank0=f"rank 0 ({rank0.node})", heartbeat=rank0.heartbeat
    )
    if announcement["reference"] != image:
        raise AnnouncementError(
            f"rank 0 announced {announcement['reference']} in {rank0.attempt_dir}, but this node was to load {image}: "
            "the announcement is not this run's (was the attempt dir reused?)"
        )
    outcome = load_image(cache, announcement["image_id"], image=image, marker_wait=marker_wait, rebuild=rebuild)
    return outcome, announcement
