"""Whether rank 0 of a multi-node run is still alive, as the other nodes see it: its heartbeat file in its node dir
(``playbook.alive`` or ``module.alive``) stood still ``stale_after`` seconds without a ``status.json``. The beat
is judged by its content, so no two nodes' clocks are compared."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import STATUS_FILE, nodes_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_file, write_file_atomically

# In rank 0's node dir, rewritten every 2 s while its playbook lives (roles/preparation).
PLAYBOOK_HEARTBEAT_FILE = "playbook.alive"
# A heartbeat that stood still this long is a dead playbook (module_utils/job/defaults.py).
HEARTBEAT_STALE_SECONDS = float(SETTING_DEFAULTS["heartbeat_stale"])


class Heartbeat:
    """Whether a heartbeat file still changes: the content, not the clock, so no two nodes' clocks are compared."""

    def __init__(self, path: str, stale_after: float = HEARTBEAT_STALE_SECONDS):
        self.path = path
        self.stale_after = stale_after
        self._last: Optional[bytes] = None
        self._changed = time.monotonic()

    def stopped(self) -> Optional[str]:
        """None while the beat goes on (or has not stood still ``stale_after`` seconds yet), else what happened."""
        try:
            beat = read_file(self.path)
        except OSError:
            beat = None
        now = time.monotonic()
        if beat != self._last:
            self._last, self._changed = beat, now
        elif now - self._changed >= self.stale_after:
            if beat is None:
                return f"never wrote its heartbeat {self.path} in {self.stale_after:g} s"
            return f"stopped its heartbeat {self.path} {now - self._changed:.0f} s ago"
        return None


# In rank 0's node dir, rewritten every BEAT_SECONDS while its barrier or run module runs (push mode).
MODULE_HEARTBEAT_FILE = "module.alive"
HEARTBEATS = {"playbook": PLAYBOOK_HEARTBEAT_FILE, "module": MODULE_HEARTBEAT_FILE}
BEAT_SECONDS = 2.0
# A beat changes every BEAT_SECONDS: reading it more often than this learns nothing (a read on shared storage).
CHECK_SECONDS = 1.0


class Rank0Watch:
    """One node's watch on rank 0: `lost()` says why rank 0 is gone, or None while it lives (see the module doc)."""

    def __init__(
        self,
        attempt_dir: str,
        rank0_node: str,
        rank: int,
        heartbeat: str = "playbook",
        stale_after: float = HEARTBEAT_STALE_SECONDS,
    ):
        rank0_dir = os.path.join(nodes_dir(attempt_dir), rank0_node)
        self._beat = Heartbeat(os.path.join(rank0_dir, HEARTBEATS[heartbeat]), stale_after)
        self._status = os.path.join(rank0_dir, STATUS_FILE)
        self._who = f"rank 0 ({rank0_node})'s " + ("own playbook" if rank == 0 else heartbeat)
        self._next_check = 0.0

    def lost(self) -> Optional[str]:
        """Why rank 0 is lost, naming it and its heartbeat; None while it beats, or once it wrote its status."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_SECONDS
        stopped = self._beat.stopped()  # every check: the beat's clock runs from when it was last seen changing
        if not stopped or os.path.exists(self._status):
            return None
        return f"{self._who} {stopped}: rank 0 is lost (killed, or its node died)"


@dataclass
class NodeLiveness:
    """What one node's module does about rank 0's liveness: the watch it keeps on rank 0 (None: none), and the
    heartbeat file it keeps itself while it runs (None: none; rank 0 in push mode)."""

    watch: Optional[Rank0Watch] = None
    beat: Optional[str] = None


def node_liveness(
    attempt_dir: Optional[str], nodes: Sequence[str], rank: int, heartbeat: str, stale_after: float
) -> NodeLiveness:
    """This node's part, by its rank: in pull mode every node watches rank 0's playbook (rank 0 its own); in push
    mode rank 0 beats and the workers watch it. Nothing with `stale_after` 0 (off), no attempt dir or one node."""
    if heartbeat not in HEARTBEATS:
        raise ValueError(f"heartbeat must be one of {', '.join(HEARTBEATS)}, got {heartbeat!r}")
    if not stale_after or not attempt_dir or len(nodes) < 2:
        return NodeLiveness()
    if heartbeat == "module" and rank == 0:
        return NodeLiveness(beat=os.path.join(nodes_dir(attempt_dir), nodes[0], MODULE_HEARTBEAT_FILE))
    return NodeLiveness(watch=Rank0Watch(attempt_dir, nodes[0], rank, heartbeat, stale_after))


@contextlib.contextmanager
def beating(path: Optional[str], interval: float = BEAT_SECONDS) -> Iterator[None]:
    """Rewrite the heartbeat file `path` (this process's pid and the time) every `interval` seconds while the block
    runs; nothing when `path` is None. The first beat is written before the block starts, so a dir that cannot take
    it fails the caller (OSError) rather than have the watchers give it up later; a later failed write only lets the
    beat stand still, which is what the watchers should see of a node whose storage is gone."""
    if path is None:
        yield
        return

    def beat() -> None:
        write_file_atomically(path, f"{os.getpid()} {time.time():.3f}\n".encode("ascii"))

    beat()
    stopped = threading.Event()

    def keep_beating() -> None:
        while not stopped.wait(interval):
            try:
                beat()
            except OSError:
                pass

    thread = threading.Thread(target=keep_beating, name="slurm-multi-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        thread.join(interval + 5)
