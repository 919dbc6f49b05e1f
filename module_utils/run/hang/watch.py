"""The hang watchdog (docs/hangs.md): each node writes its progress count (`NodeProgress`); rank 0 calls the run hung
when no count changed for ``hang_timeout`` by its own clock (`HangJudge`), so no two nodes' clocks are compared."""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.cgroup_block_io import (
    block_io_file,
    read_block_io_bytes,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.pyspy_ranks import PYSPY
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically

PROGRESS_FILE = "progress.json"
# A rank blocked in a collective uses next to no CPU (torchrun's agent polls its workers ten times a second: well
# under 1% of a core); a rank computing uses most of one.
BUSY_CPU_SHARE = 0.05
HANG_KIND = "hang"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def sample_interval(hang_timeout: float) -> float:
    """Seconds between two samples: five per ``hang_timeout``, at least one second apart, at most ten."""
    return min(max(hang_timeout / 5.0, 1.0), 10.0)


class Activity(NamedTuple):
    """What a process did so far, from /proc: CPU seconds (with its reaped children's), storage bytes (not sockets;
    None where /proc/<pid>/io is not this user's), and whether it is runnable now."""

    cpu: float
    storage_bytes: Optional[int]
    runnable: bool


def process_activity(pid: int) -> Optional[Activity]:
    """A process's `Activity`; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    storage: Optional[int] = 0
    try:
        with open(f"/proc/{pid}/io", "rb") as io:
            for line in io:
                name, _, value = line.partition(b":")
                if name in (b"read_bytes", b"write_bytes"):
                    storage += int(value)
    except (OSError, ValueError):
        storage = None  # only the tracer's to read: the container's cgroup tells instead
    # After the command's closing parenthesis: state is field 0, utime 11, stime 12, cutime 13, cstime 14.
    # Runnable (R): a rank the scheduler has not given a core yet (a loaded node) is busy, not hung.
    cpu = sum(int(value) for value in fields[11:15]) / _CLOCK_TICKS
    return Activity(cpu, storage, fields[0] == b"R")


def container_activity(container: str) -> Dict[int, Activity]:
    """Each process's `Activity`, by host PID; {} when the container is not running. The pyspy_record tool's
    samplers are left out: sampling a blocked rank costs them more CPU than `BUSY_CPU_SHARE`."""
    listed = docker_api.container_processes(container)  # every tick: no CLI process where the API answers
    if listed is None:
        try:
            lines = run_docker(["top", container, "-eo", "pid,args"], timeout=30).stdout.splitlines()[1:]
        except DockerError:
            return {}
        listed = [(pid, args) for pid, _, args in (line.strip().partition(" ") for line in lines)]
    pids = [int(pid) for pid, args in listed if pid.isdigit() and not args.strip().startswith(PYSPY)]
    activity = {pid: process_activity(pid) for pid in pids}
    return {pid: done for pid, done in activity.items() if done is not None}


class NodeProgress:
    """This node's progress count: one more each sample in which its container's log grew, its processes used CPU or
    storage, one of them was runnable, or one started or ended."""

    def __init__(
        self,
        container: str,
        log_path: str,
        progress_path: str,
        node: str,
        rank: int,
        activity: Optional[Callable[[], Optional[Dict[int, Activity]]]] = None,
    ):
        self.container = container
        # The runtime's reading of its rank's processes (a host process tree); None from it: read the container.
        self._read_activity = activity
        self.log_path = log_path
        self.progress_path = progress_path
        self.node = node
        self.rank = rank
        self.count = 0
        self._log_bytes = -1
        self._activity: Optional[Dict[int, Activity]] = None
        self._sampled_at: Optional[float] = None
        self._block_io_file: Optional[str] = None
        self._block_io: Optional[int] = None

    def _container_block_io(self, activity: Mapping[int, Activity]) -> Optional[int]:
        """The container's cgroup's block I/O; None while every process's own counters are readable (they count
        a network file system's reads too) or where the cgroup's cannot be read."""
        if all(done.storage_bytes is not None for done in activity.values()):
            return None
        self._block_io_file = self._block_io_file or block_io_file(activity)
        return read_block_io_bytes(self._block_io_file) if self._block_io_file else None

    def sample(self, now: float) -> bool:
        """Take a sample at monotonic time ``now``; True when the node made progress since the last one."""
        try:
            log_bytes = os.stat(self.log_path).st_size
        except OSError:
            log_bytes = 0
        activity = self._read_activity() if self._read_activity else None
        if activity is None:
            activity = container_activity(self.container)
        block_io = self._container_block_io(activity)
        progressed = self._sampled_at is None or log_bytes != self._log_bytes
        if not progressed and self._activity is not None:
            before = self._activity
            used = sum(activity[pid].cpu - before[pid].cpu for pid in activity if pid in before)
            block_io_moved = None not in (block_io, self._block_io) and block_io != self._block_io
            progressed = (
                set(activity) != set(before)
                or used >= BUSY_CPU_SHARE * (now - self._sampled_at)
                or any(activity[pid].storage_bytes != before[pid].storage_bytes for pid in activity)
                or block_io_moved
                or any(done.runnable for done in activity.values())
            )
        self._log_bytes, self._activity, self._sampled_at, self._block_io = log_bytes, activity, now, block_io
        if progressed:
            self.count += 1
            record = {"node": self.node, "rank": self.rank, "count": self.count, "at": time.time()}
            write_file_atomically(self.progress_path, json.dumps(record).encode("utf-8"))
        return progressed


def read_progress_count(path: str) -> Optional[int]:
    """A node's progress count from its progress.json; None while it wrote none (or one half-read)."""
    try:
        with open(path, encoding="utf-8") as progress:
            count = json.load(progress).get("count")
    except (OSError, ValueError, AttributeError):
        return None
    return count if isinstance(count, int) else None


class HangJudge:
    """Rank 0's view of every node's progress count: the run is hung once none changed for ``hang_timeout``."""

    def __init__(self, nodes: Sequence[str], hang_timeout: float, now: float):
        self.hang_timeout = hang_timeout
        self._counts: Dict[str, Optional[int]] = {node: None for node in nodes}
        self._last_change = now

    def observe(self, counts: Mapping[str, Optional[int]], now: float) -> Optional[str]:
        """Take every node's count at monotonic time ``now``; the hang's reason, or None while the run moves."""
        for node, count in counts.items():
            if count != self._counts.get(node):
                self._counts[node] = count
                self._last_change = now
        if now - self._last_change >= self.hang_timeout:
            return f"hang: no rank made progress for {self.hang_timeout:g} s"
        return None


class HangWatch:
    """One node's part of the watchdog, ticked by the run's wait loop: it samples this node's progress and, on rank 0,
    judges every node's."""

    def __init__(
        self,
        container: str,
        log_path: str,
        node_dirs: Mapping[str, str],
        node: str,
        rank: int,
        hang_timeout: float,
        now: Optional[float] = None,
        activity: Optional[Callable[[], Optional[Dict[int, Activity]]]] = None,
    ):
        now = time.monotonic() if now is None else now
        self.interval = sample_interval(hang_timeout)
        self.progress = NodeProgress(
            container, log_path, os.path.join(node_dirs[node], PROGRESS_FILE), node, rank, activity
        )
        self.node = node
        self.node_dirs = dict(node_dirs)
        self.judge = HangJudge(list(node_dirs), hang_timeout, now) if rank == 0 else None
        self._next = now

    def tick(self, now: Optional[float] = None) -> Optional[str]:
        """Sample when one is due; on rank 0, the hang's reason once every node stood still for ``hang_timeout``."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.interval
        self.progress.sample(now)
        if self.judge is None:
            return None
        counts = {
            node: self.progress.count if node == self.node else read_progress_count(os.path.join(path, PROGRESS_FILE))
            for node, path in self.node_dirs.items()
        }
        return self.judge.observe(counts, now)
