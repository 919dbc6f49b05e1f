"""One node's part of the barrier in a run: the candidate ports, the checks that end a wait early (ABORT marker, a
stopped heartbeat), the marker rank 0 leaves when it cannot open the barrier at all, and the result's fields."""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import (
    BarrierAborted,
    BarrierError,
    BarrierFailed,
    BarrierTimeout,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_TIMEOUT,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.server import RankBarrierServer
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    DEFAULT_PORT_CANDIDATES,
    DEFAULT_PORT_RANGE,
    derive_barrier_ports,
    parse_port_range,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.worker import join_rank_barrier
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import nodes_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import (
    PLAYBOOK_HEARTBEAT_FILE,
    Heartbeat,
    Rank0Watch,
)


@dataclass
class NodeAtBarrier:
    """What one node brings to the barrier (the rank_barrier module's options)."""

    rank: int
    nnodes: int
    master_addr: str
    master_port: int
    job_id: str
    token: str
    image_id: str
    hosts: Sequence[str] = ()
    timeout: float = DEFAULT_TIMEOUT
    port_range: str = "{}-{}".format(*DEFAULT_PORT_RANGE)
    port_candidates: int = DEFAULT_PORT_CANDIDATES
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    job_dir: Optional[str] = None
    heartbeat_stale: float = 0.0
    heartbeat: str = "playbook"

    @property
    def ports(self) -> List[int]:
        """The candidate ports, the same on every node: derived from the job's MASTER_PORT and ID."""
        return derive_barrier_ports(
            self.master_port, self.job_id, parse_port_range(self.port_range), self.port_candidates
        )


class _ModuleLogHandler(logging.Handler):
    """Sends the barrier's log records (rejections with peer addresses) to the node's syslog via the module."""

    def __init__(self, module: Any):
        super().__init__(logging.INFO)
        self._module = module

    def emit(self, record: logging.LogRecord) -> None:
        self._module.log(self.format(record))


def barrier_logger(module: Any) -> logging.Logger:
    """The barrier's logger in a module (its `log`: the node's syslog), never stdout: that is the module's result."""
    logger = logging.getLogger("slurm_multi.rank_barrier.module")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.handlers[:] = [_ModuleLogHandler(module)]
    return logger


def meet_every_node(
    node: NodeAtBarrier, logger: logging.Logger, rank0_watch: Optional[Rank0Watch] = None
) -> Dict[str, Any]:
    """Wait at the barrier as `node`'s rank: the result's fields (port, waited_seconds, workers, rejected) and the
    `warnings` to show, or BarrierFailed saying why. `rank0_watch`: how a worker sees rank 0 lost (liveness.py)."""
    marker_seen: Dict[str, Any] = {}
    # The workers' heartbeats first: their clocks then start first, and a worker found dead is named before rank 0
    # (which would be "lost" too) when both stood still from the start.
    worker_heartbeats = _worker_heartbeats(node)
    own_node = (list(node.hosts) or [None])[0] if node.rank == 0 else None
    abort_check = None
    if node.job_dir:
        abort_check = _run_given_up(node.job_dir, marker_seen, worker_heartbeats, rank0_watch, own_node)
    try:
        if node.rank == 0:
            with RankBarrierServer(
                node.master_addr,
                node.ports,
                node.nnodes,
                node.image_id,
                node.token,
                list(node.hosts) or None,
                node.idle_timeout,
                logger,
                job_id=node.job_id,
            ) as server:
                outcome = server.serve(node.timeout, abort_check)
        else:
            outcome = join_rank_barrier(
                node.master_addr,
                node.ports,
                node.rank,
                node.nnodes,
                node.token,
                node.image_id,
                node.timeout,
                connect_timeout=node.connect_timeout,
                abort_check=abort_check,
                logger=logger,
                job_id=node.job_id,
            )
    except BarrierError as error:
        raise BarrierFailed(str(error), _failure_fields(node, error, marker_seen)) from None
    warnings = list(outcome.warnings)
    if outcome.rejections and node.rank == 0:
        warnings.insert(0, f"rank 0 rejected {len(outcome.rejections)} connection(s) at the barrier; see 'rejected'")
    elif outcome.rejections:
        warnings.insert(
            0,
            f"rank {node.rank} refused {len(outcome.rejections)} answer(s) that failed the barrier's authentication "
            "(another job's barrier or an impostor on a candidate port); see 'rejected'",
        )
    return dict(
        port=outcome.port,
        waited_seconds=outcome.waited_seconds,
        workers=outcome.workers,
        rejected=outcome.rejections,
        warnings=warnings,
    )


def _failure_fields(node: NodeAtBarrier, error: BarrierError, marker_seen: Dict[str, Any]) -> Dict[str, Any]:
    """The failed result's fields; a rank 0 that never listened leaves the ABORT marker the workers check for."""
    # Timeouts and aborts were told to every connected worker; a rank 0 that never listened told no one (a rank 0
    # whose own playbook died wrote its marker already).
    never_listened = not isinstance(error, (BarrierTimeout, BarrierAborted))
    fields: Dict[str, Any] = dict(rejected=error.rejections)
    if node.rank == 0 and never_listened and node.job_dir:
        # Rank 0 could not open the barrier: the waiting workers check for the ABORT marker.
        try:
            write_abort_marker(node.job_dir, 0, (list(node.hosts) or [platform.node()])[0], str(error))
        except OSError as marker_error:
            fields["warnings"] = [
                f"could not write the ABORT marker in {node.job_dir} ({marker_error.strerror}): "
                "the workers stop only at their barrier timeout"
            ]
    if node.rank > 0 and "rank0_lost" in marker_seen:
        fields["aborted_by_rank"] = 0
    elif node.rank > 0 and not marker_seen and node.job_dir:
        # Rank 0's ABORT reached this worker first: the marker (if any) names the rank that failed.
        marker_seen.update(read_abort_marker(node.job_dir) or {})
    if "rank" in marker_seen:
        fields["aborted_by_rank"] = marker_seen.get("rank")
    if isinstance(error, BarrierTimeout) and error.missing:
        fields["missing"] = [{"rank": rank, "host": host} for rank, host in error.missing]
    return fields


def _run_given_up(job_dir: str, seen: dict, worker_heartbeats=(), rank0_watch=None, own_node=None):
    """The abort check: why the run ended elsewhere (the ABORT marker, kept in `seen`; a worker's stalled heartbeat;
    rank 0 lost) or None. On rank 0, its own dead playbook goes into the ABORT marker before its ABORT goes out."""

    def check():
        marker = read_abort_marker(job_dir)
        if marker:
            seen.update(marker)
            return f"rank {marker.get('rank')} ({marker.get('node')}) gave up: {marker.get('reason')}"
        for rank, host, heartbeat in worker_heartbeats:
            stopped = heartbeat.stopped()
            if stopped:
                return f"rank {rank} ({host}) {stopped}: its node or its playbook is gone"
        lost = rank0_watch.lost() if rank0_watch else None
        if lost:
            seen["rank0_lost"] = lost
            if own_node:
                write_abort_marker(job_dir, 0, own_node, lost)
        return lost

    return check


def _worker_heartbeats(node: NodeAtBarrier) -> list:
    """Rank 0 in pull mode: (rank, host, Heartbeat) of every worker, from its node dir; none otherwise."""
    hosts = list(node.hosts)
    if node.rank != 0 or not node.heartbeat_stale > 0 or not node.job_dir or not hosts:
        return []
    if node.heartbeat != "playbook":
        return []  # push mode: a worker's module beats nothing between tasks, and the srun connection watches it
    nodes = nodes_dir(node.job_dir)
    return [
        (rank, host, Heartbeat(os.path.join(nodes, host, PLAYBOOK_HEARTBEAT_FILE), node.heartbeat_stale))
        for rank, host in enumerate(hosts[1 : node.nnodes], start=1)
    ]
