"""Run one node's model container of a multi-node job to its end, and decide that node's verdict.

Every way out (exit, deadline, ABORT marker, rank 0 lost, hang, signal) records the same status fields; a model
failure is data, only infrastructure errors raise `ModelRunError`. A rank about to stop takes its evidence first,
since its stop breaks its peers' collective."""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import NodeLiveness, Rank0Watch, beating
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.model_card_fields import skipped_gpu_arch
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import step_record, valid_steps
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.cancellation import Cancellation
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import (
    ContainerRuntime,
    Rank,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import STACKS_JSON
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.stacks import write_stacks
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import HANG_KIND, HangWatch
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import distributed_from_dict
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRun,
    ModelRunError,
    container_gpus,
    gpu_architecture,
    inside_model_dir,
    run_environment,
    run_launcher_environment,
    validate,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import scan_log_file
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import tool_names, tool_outputs, tools_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

CANCEL_STOP_GRACE = 5
CANCEL_LOG_DRAIN_TIMEOUT = 3.0
LOG_DRAIN_TIMEOUT = 30.0
HANG_STACKS_WAIT = 10.0
# A rank ended by SIGTERM, SIGINT or SIGHUP (128 + N), and how long the same signal may take to reach this module.
CANCEL_EXIT_CODES = (128 + 15, 128 + 2, 128 + 1)
CANCEL_SIGNAL_WAIT = 1.0


@dataclass
class RunOutcome:
    """What a run did: the node's status (docs/contracts.md schema) and where its files are."""

    status: Dict[str, object]
    container: str
    started: bool
    log_path: str
    status_path: str
    diagnostics_path: Optional[str] = None
    # The results CSVs copied into the node dir: the card's multiple_results and each local rank's.
    results_csvs: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    # What the barrier before the container gave (port, waited_seconds, workers, rejected); None without one.
    barrier: Optional[Dict[str, object]] = None

    @property
    def results_csv(self) -> Optional[str]:
        """The first results CSV copied (the card's own name sorts before its ranks'), or None."""
        return self.results_csvs[0] if self.results_csvs else None


def _file_signature(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def _deadline(run: ModelRun) -> Tuple[Optional[float], str]:
    """(monotonic deadline, why) from the model's timeout and the job's end minus the margin; (None, "") if none."""
    candidates = []
    if run.timeout and run.timeout > 0:  # MAD's -1: no timeout
        candidates.append((time.monotonic() + run.timeout, f"the model's timeout of {run.timeout:g} s was reached"))
    if run.job_end_time:
        ends = datetime.datetime.fromtimestamp(run.job_end_time, datetime.timezone.utc).isoformat(timespec="seconds")
        left = run.job_end_time - run.end_margin - time.time()
        candidates.append(
            (time.monotonic() + left, f"the job ends at {ends}: stopped {run.end_margin:g} s before its end")
        )
    return min(candidates) if candidates else (None, "")


class _NodeRun:
    """One run's state, so that every way out (exit, abort, timeout, cancel, error) records the same fields."""

    def __init__(
        self,
        run: ModelRun,
        cancellation: Cancellation,
        rank: Rank,
        rank0: Optional[Rank0Watch] = None,
        meet_other_nodes: Optional[Callable[[], Dict[str, object]]] = None,
        errors: Tuple[type, ...] = (),
    ):
        self.run = run
        self.rank = rank
        # The runtime's own infrastructure errors, beside OSError and UserError.
        self.errors = errors
        self.cancellation = cancellation
        self.rank0 = rank0
        self.meet_other_nodes = meet_other_nodes
        self.barrier = None  # type: Optional[Dict[str, object]]
        self.log_path = os.path.join(run.node_dir, job_layout.RUN_LOG)
        self.status_path = os.path.join(run.node_dir, job_layout.STATUS_FILE)
        self.diagnostics_path = None  # type: Optional[str]
        self.results_csvs = []  # type: List[str]
        self.secret_values = []  # type: List[str]
        self.warnings = []  # type: List[str]
        self.started = False
        # The node's earlier steps (preflight, build, load, barrier) as their modules returned them; the run adds
        # its own (container_start, run, diagnostics) as it does them.
        self.steps = valid_steps(run.steps)
        self.status = job_layout.new_status(
            run.node,
            run.rank,
            run.nnodes,
            run.job_id,
            run.model,
            started_at=time.time(),
            steps=self.steps,
            hostname=socket.gethostname(),
        )  # type: Dict[str, object]

    def fail(self, reason: str, **fields) -> None:
        self.status.update(fields)
        self.status["status"] = job_layout.FAILURE
        reasons = [r for r in (self.status["reason"], reason) if r]
        self.status["reason"] = mask_secrets("; ".join(reasons), self.secret_values)

    def raise_abort(self) -> None:
        """Tell the other ranks to stop (fail fast); the first rank's marker stands."""
        try:
            write_abort_marker(self.run.attempt_dir, self.run.rank, self.run.node, str(self.status["reason"]))
        except OSError as err:
            self.warnings.append(f"could not write the abort marker in {self.run.attempt_dir}: {err}")

    def snapshot(self) -> None:
        """Diagnostics beside the log; a failure to write them is a warning, the run's failure stands."""
        path = os.path.join(self.run.node_dir, job_layout.DIAGNOSTICS_FILE)
        started = time.time()
        try:
            self.diagnostics_path = self.rank.snapshot(
                path,
                log_dirs=self.run.diagnostics_log_dirs,
                secret_values=self.secret_values,
                budget=self.run.diagnostics_budget,
                reason=str(self.status["reason"]),
            )
        except OSError as err:
            self.warnings.append(f"could not write {path}: {err}")
        self.steps["diagnostics"] = step_record(started)

    def take_stacks(self, why: str) -> None:
        """Every process's stacks into stacks.txt and stacks.json beside the log; a failure is a warning."""
        started = time.time()
        try:
            stacks = self.rank.stacks(why, self.secret_values, self.log_path)
            write_stacks(self.run.node_dir, stacks)
        except (OSError, UserError, *self.errors) as err:
            self.warnings.append(f"could not take the stacks of {self.run.container}: {err}")
        self.steps["diagnostics"] = step_record(started)

    def write_status(self) -> None:
        self.status["ended_at"] = time.time()
        self.status["tools"] = tool_names(self.run.tools)
        self.status["tool_outputs"] = tool_outputs(self.run.node_dir)
        try:
            job_layout.write_status(self.status_path, self.status)
        except OSError as err:
            raise ModelRunError(f"cannot write {self.status_path}: {err}") from None


def _wait(
    run: ModelRun,
    rank: Rank,
    cancellation: Cancellation,
    deadline: Optional[float],
    rank0: Optional[Rank0Watch] = None,
    hang_watch: Optional[HangWatch] = None,
) -> Tuple[str, object]:
    """Wait for the container: ("exited", None), ("aborted", marker), ("hang", marker), ("rank0_lost", why),
    ("timed_out", None) or ("cancelled", None)."""
    watch = rank.watch()
    try:
        while True:
            if cancellation.requested:
                return "cancelled", None
            if watch.ended():
                return "exited", None
            hang = hang_watch.tick() if hang_watch else None
            if hang:
                # Rank 0 called it: the first marker stands (a rank that failed meanwhile is the cause, not a hang).
                write_abort_marker(run.attempt_dir, run.rank, run.node, hang, kind=HANG_KIND)
            marker = read_abort_marker(run.attempt_dir)
            if marker is not None:
                return ("hang" if marker.get("kind") == HANG_KIND else "aborted"), marker
            lost = rank0.lost() if rank0 else None
            if lost:
                return "rank0_lost", lost
            if deadline is not None and time.monotonic() >= deadline:
                return "timed_out", None
            watch.sleep(run.poll_interval)
    finally:
        watch.close()


def _abort_reason(marker: Mapping[str, object]) -> str:
    return f"aborted because rank {marker.get('rank')} ({marker.get('node')}) failed: {marker.get('reason')}"


def _scan_log(node_run: _NodeRun, judge: bool) -> None:
    """Count the perf lines and find an error pattern; ``judge``: a hit makes the node fail (its own end)."""
    scan = scan_log_file(node_run.log_path, node_run.run.error_patterns)
    node_run.status["perf_lines"] = len(scan.perf_lines)
    node_run.status["error_pattern"] = scan.error_pattern
    if judge and scan.error_pattern is not None:
        node_run.fail(f"error pattern {scan.error_pattern!r} in the log: {(scan.error_line or '')[:300]}")


def _results_files(run: ModelRun) -> Dict[str, Tuple[int, int, int]]:
    """The model's results CSVs now (its multiple_results and each local rank's ``<stem>_rank<N>`` beside it), by
    path, with what identifies each file's content (a file the run did not rewrite keeps it)."""
    if not run.multiple_results:
        return {}
    where = os.path.dirname(inside_model_dir(run.model_dir, run.multiple_results, "multiple_results"))
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return {}
    paths = [os.path.join(where, name) for name in names if job_layout.is_results_file(name, run.multiple_results)]
    signatures = {path: _file_signature(path) for path in paths}
    return {path: signature for path, signature in signatures.items() if signature is not None}


def _copy_results_csvs(node_run: _NodeRun, before: Dict[str, Tuple[int, int, int]]) -> List[str]:
    """Copy the results CSVs this run wrote into the node dir (a file the same as before the run is not)."""
    run = node_run.run
    if not run.multiple_results:
        return []
    now = _results_files(run)
    written = [path for path, signature in now.items() if before.get(path) != signature]
    if not now:
        node_run.warnings.append(f"the model wrote no {run.multiple_results}")
    elif not written:
        node_run.warnings.append(f"{run.multiple_results} was not rewritten by this run: not copied")
    copied = []
    for source in written:
        copied.append(os.path.join(run.node_dir, os.path.basename(source)))
        shutil.copyfile(source, copied[-1])
    return copied


def run_model_container(
    run: ModelRun,
    cancellation: Optional[Cancellation] = None,
    liveness: Optional[NodeLiveness] = None,
    meet_other_nodes: Optional[Callable[[], Dict[str, object]]] = None,
    *,
    runtime: ContainerRuntime,
) -> RunOutcome:
    """Run this node's container to its end under ``runtime`` (module_utils/runtimes) and write the node's status.json.

    Raises ModelRunError for infrastructure errors and bad input, after writing the ABORT marker and a FAILURE status
    where the results dir allows, so the other ranks stop too; the barrier's BarrierFailed propagates."""
    cancellation = cancellation or Cancellation()
    liveness = liveness or NodeLiveness()
    validate(run)
    try:
        os.makedirs(run.node_dir, exist_ok=True)
        if not os.access(run.node_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as err:
        raise ModelRunError(f"the results dir {run.node_dir} is not usable on {run.node}: {err}") from None
    node_run = _NodeRun(run, cancellation, runtime.rank(run), liveness.watch, meet_other_nodes, runtime.errors)
    node_run.image_holder = runtime.image_holder
    node_run.status["container_runtime"] = runtime.name
    try:
        with beating(liveness.beat):
            _run(node_run)
    except (ModelRunError, OSError, *runtime.errors) as err:
        message = mask_secrets(str(err), node_run.secret_values)
        node_run.fail(f"infrastructure error: {message}")
        node_run.raise_abort()
        try:
            node_run.write_status()
        except ModelRunError:
            pass  # the results dir is what broke: the error below says so
        raise ModelRunError(message) from None
    return RunOutcome(
        status=node_run.status,
        container=run.container,
        started=node_run.started,
        log_path=node_run.log_path,
        status_path=node_run.status_path,
        diagnostics_path=node_run.diagnostics_path,
        results_csvs=node_run.results_csvs,
        warnings=node_run.warnings,
        barrier=node_run.barrier,
    )


def _run(node_run: _NodeRun) -> None:
    run = node_run.run
    environment = run_environment(run)
    node_run.secret_values = environment.secret_values
    node_run.warnings += environment.warnings
    deadline, deadline_reason = _deadline(run)

    # Before the ABORT marker: where every node skips, each says SKIPPED, whoever wrote the marker first.
    skipped_by = skipped_gpu_arch(run.skip_gpu_arch, run.gpus)
    if skipped_by:
        node_run.status["status"] = job_layout.SKIPPED
        node_run.status["reason"] = f"skip_gpu_arch {skipped_by!r} matches {run.node}'s GPUs: the model does not run"
        # The other ranks stop too: a model missing a rank would wait for it until its timeout.
        node_run.raise_abort()
        node_run.write_status()
        return
    marker = read_abort_marker(run.attempt_dir)
    if marker is not None:
        node_run.fail(_abort_reason(marker), aborted_by_rank=marker.get("rank"))
    elif node_run.cancellation.requested:
        node_run.fail(node_run.cancellation.reason, cancelled=True)
        node_run.raise_abort()
    elif deadline is not None and deadline <= time.monotonic():
        node_run.fail(f"not started: {deadline_reason}", timed_out=True)
        node_run.raise_abort()
    if node_run.status["status"] == job_layout.FAILURE:
        node_run.write_status()
        return
    if node_run.meet_other_nodes:
        # No container starts before every node holds rank 0's image.
        barrier_started = time.time()
        node_run.barrier = node_run.meet_other_nodes()
        node_run.steps["barrier"] = step_record(barrier_started)
    node_run.status["launcher"] = distributed_from_dict(run.distributed).launcher
    node_run.status["provenance"] = dict(run.provenance)
    rank = node_run.rank
    node_run.status["image_id"] = rank.image_identity()
    if node_run.status["image_id"] is None:
        raise ModelRunError(
            f"image {run.image} is not on {run.node}'s {node_run.image_holder}: the build stage should have loaded it"
        )
    rank.clear_leftover()  # a leftover of an earlier attempt of this very job and rank
    csv_before = _results_files(run)
    try:
        gpus = container_gpus(run)
        node_run.status["n_gpus"] = None if gpus is None else len(gpus)
        node_run.status["gpu_architecture"] = gpu_architecture(gpus)
        launch = run_launcher_environment(run)
        if run.tools:
            # Made here, by this user: a mount point Docker made would be root's.
            os.makedirs(tools_dir(run.node_dir), exist_ok=True)
        for name, content in launch.workspace_files.items():
            # Where the job's files live, never through a link, and nothing left in the user's model dir.
            write_file_atomically(os.path.join(run.node_dir, name), content.encode("utf-8"))
        node_run.status["started_at"] = time.time()
        rank.start(environment.variables, launch, node_run.log_path, node_run.secret_values)
        node_run.steps["container_start"] = step_record(node_run.status["started_at"])
        node_run.started = True
        _follow_to_the_end(node_run, deadline, deadline_reason)
        node_run.results_csvs = _copy_results_csvs(node_run, csv_before)
    finally:
        # Also after a failed start: `docker run` leaves a created container behind when the start fails.
        try:
            rank.remove()
        except node_run.errors as err:
            node_run.warnings.append(f"could not remove {run.container} (the next job's cleanup will): {err}")
    node_run.write_status()


def _hang_watch(node_run: _NodeRun) -> Optional[HangWatch]:
    """This node's part of the hang watchdog (module_utils/run/hang/watch.py); None when it is off."""
    run = node_run.run
    if not run.hang_timeout or run.hang_timeout <= 0:
        return None
    nodes = list(run.allocation_nodes) or [run.node]
    if run.node not in nodes:
        nodes.append(run.node)
    node_dirs = {node: job_layout.node_dir(run.results_dir, run.job_id, run.attempt, node) for node in nodes}
    return HangWatch(
        run.container,
        node_run.log_path,
        node_dirs,
        run.node,
        run.rank,
        run.hang_timeout,
        activity=node_run.rank.activity,
    )


def _ended_by_the_jobs_cancel(rank: Rank, cancellation: Cancellation) -> bool:
    """Whether the rank ended by a signal that is cancelling this module too: where the rank is one of the step's own
    processes (no daemon between), SLURM's SIGTERM may reach it a moment before this module."""
    _, exit_code = rank.state()
    if exit_code not in CANCEL_EXIT_CODES:
        return False
    deadline = time.monotonic() + CANCEL_SIGNAL_WAIT
    while not cancellation.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    return cancellation.requested


def _follow_to_the_end(node_run: _NodeRun, deadline: Optional[float], deadline_reason: str) -> None:
    run = node_run.run
    rank = node_run.rank
    follower = rank.follow_log(node_run.log_path, node_run.secret_values)
    run_started = time.time()
    try:
        ending, marker = _wait(run, rank, node_run.cancellation, deadline, node_run.rank0, _hang_watch(node_run))
    finally:
        # Also when watching the container failed (docker gone): the run's step still ends where it broke.
        node_run.steps["run"] = step_record(run_started)
    if ending == "exited" and _ended_by_the_jobs_cancel(rank, node_run.cancellation):
        ending = "cancelled"

    if ending == "exited":
        follower.drain(LOG_DRAIN_TIMEOUT)
        _, exit_code = rank.state()
        node_run.status["exit_code"] = exit_code
        if exit_code != 0:
            node_run.fail(f"the container exited with code {exit_code}")
        _scan_log(node_run, judge=True)
        if node_run.status["status"] == job_layout.FAILURE:
            node_run.raise_abort()
            node_run.snapshot()
        return

    if ending == "aborted":
        node_run.fail(_abort_reason(marker), aborted_by_rank=marker.get("rank"))
        node_run.snapshot()  # still running: the snapshot looks inside before it stops
        rank.stop(run.stop_grace)
    elif ending == "hang":
        node_run.fail(str(marker.get("reason")), hang=True)
        node_run.take_stacks("hang")  # still running: the stacks are what the ranks are stuck in
        _until_the_other_nodes_took_their_stacks(run)
        rank.stop(run.stop_grace)
    elif ending == "rank0_lost":
        # Rank 0 is the cause: a worker blames it; rank 0 itself (its own playbook died) tells the workers.
        node_run.fail(str(marker), aborted_by_rank=0)
        if run.rank == 0:
            node_run.raise_abort()
        node_run.snapshot()
        rank.stop(run.stop_grace)
    else:
        if ending == "cancelled":
            node_run.fail(node_run.cancellation.reason, cancelled=True)
        else:
            node_run.fail(deadline_reason, timed_out=True)
        node_run.raise_abort()
        node_run.snapshot()
        rank.stop(CANCEL_STOP_GRACE if ending == "cancelled" else run.stop_grace)
    # After a signal, SLURM's SIGKILL comes KillWait (30 s) after its SIGTERM: drain the log briefly.
    follower.drain(CANCEL_LOG_DRAIN_TIMEOUT if ending == "cancelled" else LOG_DRAIN_TIMEOUT)
    node_run.status["exit_code"] = rank.state()[1]
    _scan_log(node_run, judge=False)  # the stop is the reason; a pattern hit is still worth recording


def _until_the_other_nodes_took_their_stacks(run: ModelRun) -> None:
    """Wait until every other node of the allocation wrote its stacks or its status, HANG_STACKS_WAIT at most."""
    others = [node for node in run.allocation_nodes if node != run.node]
    dirs = [job_layout.node_dir(run.results_dir, run.job_id, run.attempt, node) for node in others]
    deadline = time.monotonic() + HANG_STACKS_WAIT
    while time.monotonic() < deadline:
        if all(
            os.path.exists(os.path.join(d, STACKS_JSON)) or os.path.exists(os.path.join(d, job_layout.STATUS_FILE))
            for d in dirs
        ):
            return
        time.sleep(0.1)
