"""Following a submitted job to its record (`submit --wait`): SLURM's state, each task's and node's outcome, the
nodes' logs (`--follow`), and a retry's new job in turn."""

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import read_sweep_plan
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import load_record, record_path
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.progress import PipelineProgress, preflight_lines
from slurm_multi.reports.job_view import FileTail, NodeLogs, job_nodelist
from slurm_multi.run_result import RunResult, job_result
from slurm_multi.submission import sbatch
from slurm_multi.submission.retry import read_retry_plan
from slurm_multi.submission.sbatch import SbatchError
from slurm_multi.submission.submit import Submission

# How often `submit --wait --follow` reads the nodes' logs (SLURM is asked every poll_interval).
LOG_POLL_INTERVAL = 0.5


def _job_info(job_id: str) -> dict[str, str] | None:
    try:
        return sbatch.job_info(job_id)
    except SbatchError as exc:
        raise SlurmMultiError(f"{exc}; job {job_id} itself is not affected") from None


def state_line(job_id: str, state: str, info: dict, nodes_shown: bool) -> tuple[str, bool]:
    """The line for a job's new state, and whether it names the job's nodes: RUNNING does, and so does the first
    state after it when SLURM was polled too seldom to see it (a job shorter than the poll interval went from PENDING
    to COMPLETED): the user still learns where it ran. A job that never started has no nodes to name."""
    ran = bool(job_nodelist(info)) and state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD")
    where = f" on {info['NodeList']}" if ran and (state == "RUNNING" or not nodes_shown) else ""
    why = f" ({info.get('Reason')})" if info.get("Reason") not in (None, "None") else ""
    return f"job {job_id}: {state}{where}{why}", bool(where)


def _node_status_line(node: str, status: Mapping[str, Any]) -> str:
    verdict = status.get("status", "?")
    details = [f"exit {status.get('exit_code')}"] if status.get("exit_code") is not None else []
    details.append(f"{status.get('perf_lines', 0)} performance line(s)")
    if status.get("reason"):
        details.append(str(status["reason"]))
    return f"{node}: {verdict} ({'; '.join(details)})"


def _sweep_attempt_dirs(results_dir: Path, job_id: str, attempt: int) -> list[Path]:
    """The attempt dirs of a sweep's models (none while the job is no sweep, or its plan is not written yet)."""
    try:
        plan = read_sweep_plan(str(results_dir), job_id, attempt)
    except job_layout.JobLayoutError:
        return []
    models = plan["models"] if plan else []
    return [Path(job_layout.attempt_dir(str(results_dir), model["job_id"], attempt)) for model in models]


def wait(
    submission: Submission,
    *,
    on_progress: Callable[[str], None] = print,
    poll_interval: float = 2.0,
    on_log_line: Callable[[str], None] | None = None,
    colour: bool = False,
) -> RunResult:
    """Follow a submitted job until it is recorded; report progress lines; return its result.

    Progress: SLURM's job state, one line per finished pipeline task with each node's outcome, each node's verdict
    as its status.json appears. Ends when the job has ended and its last attempt's record exists, or when the
    collect job has ended without one (``recorded`` False). ``on_log_line`` gets every rank's new log lines,
    prefixed ``node3 r2 | ``. A job that the collect job resubmitted without some nodes is followed to its end in
    turn (its result is returned; ``retries`` names every attempt).
    """
    while True:
        result = _follow(submission, on_progress, poll_interval, on_log_line, colour)
        retried_as = _retry_decision(submission, on_progress, poll_interval)
        if retried_as is None and not result.recorded:
            return result
        if retried_as is None:
            # Read again: the collect job may have added the attempts (``retries``) to the record since.
            return job_result(submission.results_dir, submission.job_id, result.rc, attempt=result.attempt)
        submission = retried_as


def _retry_decision(
    submission: Submission, on_progress: Callable[[str], None], poll_interval: float
) -> Submission | None:
    """For a job submitted with retries: wait for its collect job's decision; the retry's Submission, if any."""
    plan = read_retry_plan(submission.private_dir) or {}
    if not (plan.get("retries") or plan.get("node_selection")):
        return None
    # The collect job adds the retry decision and the node selection to the record: the result shows them.
    while sbatch.job_state(_job_info(submission.collect_job_id)) in sbatch.ACTIVE_JOB_STATES:
        time.sleep(poll_interval)
    try:
        record = load_record(str(submission.results_dir), submission.job_id) or {}
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    entries = [entry for entry in record.get("retries") or [] if entry.get("job_id") == submission.job_id]
    if not entries or record.get("status") in ("SUCCESS", "SKIPPED"):
        return None
    entry = entries[-1]
    on_progress(f"job {submission.job_id}: {entry.get('why')}")
    retried_as = entry.get("retried_as") or {}
    if not retried_as.get("job_id"):
        return None
    return Submission(
        retried_as["job_id"], retried_as["collect_job_id"], submission.results_dir, submission.private_dir
    )


def _follow(
    submission: Submission,
    on_progress: Callable[[str], None],
    poll_interval: float,
    on_log_line: Callable[[str], None] | None,
    colour: bool,
) -> RunResult:
    """One job of `wait`, followed to its record (or to its collect job ending without one)."""
    node_logs: dict[Path, NodeLogs] = {}

    def show_logs(dirs: list[Path], final: bool = False) -> None:
        if on_log_line is None:
            return
        for where in dirs:
            logs = node_logs.setdefault(where, NodeLogs(where, colour=colour))
            logs.nodelist = job_nodelist(info) or logs.nodelist
            for line in logs.new_lines(final):
                on_log_line(line)

    progress = PipelineProgress(on_progress)
    output = FileTail(submission.output)
    seen_statuses: set = set()
    preflight_shown: set = set()
    last_state, nodes_shown = None, False
    while True:
        info = _job_info(submission.job_id)
        state = sbatch.job_state(info)
        if state and state != last_state:
            line, shows_nodes = state_line(submission.job_id, state, info, nodes_shown)
            on_progress(line)
            last_state, nodes_shown = state, nodes_shown or shows_nodes
        for _, line in output.new_lines():
            progress.feed_output_line(line)
        attempt = sbatch.job_attempt(info)
        attempt_dir = Path(job_layout.attempt_dir(str(submission.results_dir), submission.job_id, attempt or 0))
        # A sweep's models write under their own job IDs (model_sweep), named in its plan.
        sweep_dirs = _sweep_attempt_dirs(submission.results_dir, submission.job_id, attempt or 0)
        for status_file in [
            path for where in [attempt_dir, *sweep_dirs] for path in sorted(where.glob("nodes/*/status.json"))
        ]:
            if status_file in seen_statuses:
                continue
            try:
                status = json.loads(status_file.read_text())
            except (OSError, ValueError):
                continue  # written by rename: a partial read only happens on a file being replaced
            seen_statuses.add(status_file)
            # Not task_finished(): the task writing the statuses is still running, and its line (every node's
            # outcome) comes when it ends.
            node = status_file.parent.name
            on_progress(_node_status_line(f"{status.get('model')} on {node}" if sweep_dirs else node, status))
        # Each node's preflight result as it lands: ok, or every problem with its fix.
        for line in preflight_lines(attempt_dir, preflight_shown):
            on_progress(line)
        show_logs([attempt_dir, *sweep_dirs])
        job_over = state not in sbatch.ACTIVE_JOB_STATES
        # The last attempt's own record: a requeued job's earlier record does not stand for its last run.
        record_file = Path(record_path(str(submission.results_dir), submission.job_id, attempt or 0))
        if job_over and record_file.is_file():
            break
        if job_over and sbatch.job_state(_job_info(submission.collect_job_id)) not in sbatch.ACTIVE_JOB_STATES:
            break
        # Following the logs reads the shared files more often than SLURM is asked: lines show within 0.5 s.
        slices = max(1, int(poll_interval / LOG_POLL_INTERVAL)) if on_log_line is not None else 1
        for _ in range(slices):
            time.sleep(poll_interval / slices)
            show_logs([attempt_dir, *sweep_dirs])
    for _, line in output.new_lines():
        progress.feed_output_line(line)
    show_logs(list(node_logs), final=True)
    progress.task_finished()
    missing_reason = (
        f"job {submission.job_id} ended ({state or 'state unknown'}) and its collect job "
        f"{submission.collect_job_id} wrote no record for attempt {attempt or 0}: see "
        f"{submission.private_dir}/collect-*.out"
    )
    return job_result(
        submission.results_dir, submission.job_id, sbatch.job_exit_code(info), missing_reason, attempt=attempt
    )
