"""A job submitted from the login node: its sbatch scripts (`plan_submission`, `submit`), following it to its
record (`wait`), and what its afterany collect job does once it has ended (`record_job_end`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_multi import sbatch
from slurm_multi.credentials import CREDENTIALS_FILE_NAME, write_credentials_copy
from slurm_multi.errors import INPUT_ERRORS, SlurmMultiError
from slurm_multi.job_vars import VARS_FILE_NAME, read_job_vars, write_job_vars
from slurm_multi.paths import default_results_dir, new_private_dir, private_jobs_dir, use_project_module_utils
from slurm_multi.progress import PipelineProgress, preflight_lines
from slurm_multi.run_result import RunResult, job_result
from slurm_multi.sbatch import SbatchError, SlurmOptions
from slurm_multi.secrets import SECRETS_FILE_NAME, user_secrets, without_secrets, write_secrets_file
from slurm_multi.spec import JobSpec, content_root

use_project_module_utils()
from ansible.module_utils import job_layout  # noqa: E402
from ansible.module_utils.build_manifest import ManifestError, load_model_cards, select_model_cards  # noqa: E402
from ansible.module_utils.job_layout import validate_job_id  # noqa: E402
from ansible.module_utils.model_sweep import read_sweep_plan, record_sweep  # noqa: E402
from ansible.module_utils.perf_record import load_record, record_path, regenerate_perf_csv  # noqa: E402
from ansible.module_utils.results_collection import write_failure_record  # noqa: E402
from ansible.module_utils.slurm_allocation import expand_nodelist  # noqa: E402

JOB_SCRIPT_NAME = "job.sbatch"
COLLECT_SCRIPT_NAME = "collect.sbatch"
SUBMISSION_FILE_NAME = "submission.json"
# Shown in dry runs in place of the job ID that sbatch has not given yet.
JOB_ID_PLACEHOLDER = "<job id>"
# How often `submit --wait --follow` reads the nodes' logs (SLURM is asked every poll_interval).
LOG_POLL_INTERVAL = 0.5
# SLURM job states in which a job may still run or write results.
ACTIVE_JOB_STATES = frozenset(
    (
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
        "SPECIAL_EXIT",
    )
)


def find_ansible_playbook() -> Path:
    """The ``ansible-playbook`` of this Python's environment, else the one on PATH: the job script runs it."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    if beside.is_file():
        return beside
    found = shutil.which("ansible-playbook")
    if found:
        return Path(found).absolute()
    raise SlurmMultiError(
        f"ansible-playbook is neither beside {sys.executable} nor on PATH: install ansible-core in this environment"
    )


@dataclass(frozen=True)
class SubmissionPlan:
    """What `submit` would write and queue (``--dry-run`` shows it): nothing exists yet."""

    private_dir: Path
    job_script: str
    collect_script: str
    job_vars: dict[str, Any]
    secret_names: tuple

    @property
    def vars_file(self) -> Path:
        """Where the job's vars file would be written."""
        return self.private_dir / VARS_FILE_NAME


@dataclass(frozen=True)
class Submission:
    """A submitted job and its afterany collect job."""

    job_id: str
    collect_job_id: str
    results_dir: Path
    private_dir: Path

    @property
    def job_dir(self) -> Path:
        """The job's results: ``<results_dir>/<job_id>/`` (nodes' logs, status files, diagnostics)."""
        return self.results_dir / self.job_id

    @property
    def output(self) -> Path:
        """The job's output file: the pipeline's Ansible output."""
        return sbatch.job_output_path(self.private_dir, self.job_id)

    @property
    def vars_file(self) -> Path:
        """The job's extra vars (strings marked unsafe)."""
        return self.private_dir / VARS_FILE_NAME


def check_time_limit(spec: JobSpec, slurm: SlurmOptions) -> None:
    """Refuse a sweep whose models' timeouts add up to more than the job's time limit: the last ones would be
    killed by SLURM instead of running (a model without a timeout, 0 or -1, counts nothing)."""
    limit = slurm.time_limit_seconds()
    if not spec.sweep or limit is None:
        return
    timeouts = [(card.get("name", "?"), _seconds(card.get("timeout"))) for card in spec.sweep]
    total = sum(seconds for _, seconds in timeouts)
    if total > limit:
        listing = ", ".join(f"{name} {seconds:g} s" for name, seconds in timeouts if seconds)
        raise SlurmMultiError(
            f"the sweep's {len(spec.sweep)} models may run {total:g} s by their timeouts ({listing}) but the time "
            f"limit --time {slurm.time} gives {limit} s: raise --time to at least {int(total)} s (plus the build), "
            "or sweep fewer models per job"
        )


def _seconds(timeout: Any) -> float:
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        return 0.0
    return seconds if seconds > 0 else 0.0


def plan_submission(
    spec: JobSpec, slurm: SlurmOptions, *, root: Path | None = None, private_dir: Path | None = None
) -> SubmissionPlan:
    """Render the job's scripts and vars without writing or submitting anything."""
    check_time_limit(spec, slurm)
    spec.check_node_count(slurm.nodes)
    root = content_root(root)
    private_dir = Path(private_dir) if private_dir else private_jobs_dir() / "<submission>"
    secrets = user_secrets(os.environ)
    secrets_file = private_dir / SECRETS_FILE_NAME if secrets else None
    credentials_copy = private_dir / CREDENTIALS_FILE_NAME if spec.credentials_file else None
    vars_file = private_dir / VARS_FILE_NAME
    try:
        job_script = sbatch.render_job_script(
            slurm, root, find_ansible_playbook(), vars_file, private_dir, spec.results_dir, spec.mode, bool(spec.sweep)
        )
        collect_script = sbatch.render_collect_script(
            slurm, JOB_ID_PLACEHOLDER, Path(sys.executable), vars_file, private_dir
        )
    except SbatchError as exc:
        raise SlurmMultiError(str(exc)) from None
    job_vars = spec.job_vars(secrets_file, credentials_copy)
    return SubmissionPlan(private_dir, job_script, collect_script, job_vars, tuple(sorted(secrets)))


def submit(
    spec: JobSpec,
    slurm: SlurmOptions,
    *,
    root: Path | None = None,
    retries: int = 0,
    preflight: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> Submission:
    """Submit the job and its afterany collect job; return both IDs.

    Writes the job's private dir (0700: scripts, vars file, 0600 secrets and credentials files) under
    `private_jobs_dir`; sbatch
    gets this process's environment without ``MAD_SECRETS_*``. The job is queued held until its collect job is
    queued too, so that no job runs without the job that records it. ``retries``: how often the collect job may
    resubmit the job without the nodes a failure is attributable to (slurm_multi.retry; never for a model failure).
    ``preflight``: check the candidate nodes first and submit on healthy ones (slurm_multi.node_selection, which
    reports to ``on_progress``); too few healthy nodes raise SlurmMultiError and nothing is submitted.
    """
    from slurm_multi import retry

    check_time_limit(spec, slurm)
    retries = retry.checked_retries(retries)
    root = content_root(root)
    selection = None
    if preflight:
        from slurm_multi.node_selection import select_nodes

        selection = select_nodes(spec, slurm, root, on_progress=on_progress)
        slurm = selection.slurm
    forget_secrets_of_forgotten_jobs()
    secrets = user_secrets(os.environ)
    environment = without_secrets(os.environ)
    private_dir = new_private_dir()
    secrets_file, credentials_copy, queued = None, None, None
    try:
        secrets_file = write_secrets_file(private_dir, secrets) if secrets else None
        if spec.credentials_file:
            credentials_copy = write_credentials_copy(private_dir, spec.credentials_file, spec.login_registry)
        vars_file = private_dir / VARS_FILE_NAME
        write_job_vars(vars_file, spec.job_vars(secrets_file, credentials_copy))
        # What a retry resubmits (the same job, other nodes); written before any job can end and read it.
        retry.write_retry_plan(
            private_dir,
            retries,
            slurm,
            spec.mode,
            bool(spec.sweep),
            spec.results_dir,
            root,
            selection.as_record() if selection else None,
        )
        queued = queue_job(slurm, root, private_dir, spec.results_dir, spec.mode, bool(spec.sweep), environment)
    except BaseException as exc:
        # Whatever failed (sbatch refused, a template error, Ctrl-C), no job will read the secrets: they go now.
        # Nothing queued: the whole private dir goes. A job queued held: queue_job cancelled it, its scripts stay.
        if not isinstance(exc, QueueError) or exc.job_id is None:
            shutil.rmtree(private_dir, ignore_errors=True)
        else:
            for private_file in (secrets_file, credentials_copy):
                if private_file:
                    private_file.unlink(missing_ok=True)
        if isinstance(exc, (SbatchError, QueueError)):
            raise SlurmMultiError(str(exc)) from None
        raise
    job_id, collect_job_id = queued
    submission = Submission(job_id, collect_job_id, spec.results_dir, private_dir)
    (private_dir / SUBMISSION_FILE_NAME).write_text(
        json.dumps(
            {
                "job_id": job_id,
                "collect_job_id": collect_job_id,
                "results_dir": str(spec.results_dir),
                "output": str(submission.output),
            },
            indent=2,
        )
        + "\n"
    )
    return submission


class QueueError(Exception):
    """Queueing a job failed; ``job_id`` is the job that was queued held and then cancelled (None: none was)."""

    def __init__(self, message: str, job_id: str | None) -> None:
        super().__init__(message)
        self.job_id = job_id


def queue_job(
    slurm: SlurmOptions,
    root: Path,
    private_dir: Path,
    results_dir: Path,
    mode: str,
    sweep: bool,
    environment: Mapping[str, str],
    name_suffix: str = "",
) -> tuple[str, str]:
    """Write the job's scripts into ``private_dir`` (its vars file already there) and queue the job and its
    afterany collect job; return both IDs. The job is queued held until its collect job is queued.

    ``name_suffix`` tells a retry's scripts apart from the first submission's (``job-retry-1.sbatch``). A failure
    after the job was queued cancels it and raises QueueError naming it.
    """
    vars_file = private_dir / VARS_FILE_NAME
    job_script = private_dir / JOB_SCRIPT_NAME.replace(".sbatch", f"{name_suffix}.sbatch")
    job_script.write_text(
        sbatch.render_job_script(slurm, root, find_ansible_playbook(), vars_file, private_dir, results_dir, mode, sweep)
    )
    job_id = sbatch.submit_script(job_script, environment, cwd=private_dir, hold=True)
    try:
        collect_script = private_dir / COLLECT_SCRIPT_NAME.replace(".sbatch", f"{name_suffix}.sbatch")
        collect_script.write_text(
            sbatch.render_collect_script(slurm, job_id, Path(sys.executable), vars_file, private_dir)
        )
        collect_job_id = sbatch.submit_script(collect_script, environment, cwd=private_dir)
        sbatch.release_job(job_id)
    except BaseException as exc:
        try:
            sbatch.cancel_job(job_id)
            cancelled = f"; job {job_id} was cancelled before it started"
        except SbatchError as cancel_error:
            cancelled = f"; job {job_id} is held and could not be cancelled ({cancel_error}): scancel it"
        if not isinstance(exc, Exception):
            raise  # Ctrl-C: the job is cancelled, the interrupt goes on
        raise QueueError(f"{exc}{cancelled}", job_id) from None
    return job_id, collect_job_id


# ---------------------------------------------------------------------------------------------------------------
# Following a submitted job


def _job_info(job_id: str) -> dict[str, str] | None:
    try:
        return sbatch.job_info(job_id)
    except SbatchError as exc:
        raise SlurmMultiError(f"{exc}; job {job_id} itself is not affected") from None


def _state(info: Mapping[str, str] | None) -> str | None:
    return info.get("JobState") if info else None


def _attempt(info: Mapping[str, str] | None) -> int | None:
    """The job's current attempt from SLURM (``Restarts``: how often it was requeued); None once SLURM forgot it."""
    restarts = (info or {}).get("Restarts", "")
    return int(restarts) if restarts.isdigit() else None


def _exit_code(info: Mapping[str, str] | None) -> int | None:
    try:
        return int((info or {}).get("ExitCode", "").split(":", 1)[0])
    except ValueError:
        return None


class _OutputFollower:
    """Reads the complete lines a growing file gained since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [line.decode("utf-8", "replace") for line in lines]


def _node_status_line(node: str, status: Mapping[str, Any]) -> str:
    verdict = status.get("status", "?")
    details = [f"exit {status.get('exit_code')}"] if status.get("exit_code") is not None else []
    details.append(f"{status.get('perf_lines', 0)} performance line(s)")
    if status.get("reason"):
        details.append(str(status["reason"]))
    return f"{node}: {verdict} ({'; '.join(details)})"


def image_stream_lines(attempt_dirs: list[Path], shown: dict) -> list[str]:
    """New progress lines of the streamed image transport: each node's bytes and rate, as its image_stream module
    rewrites ``image_stream.rank<N>.json`` every few seconds for images over 1 GB (``shown``: what was said)."""
    lines = []
    for path in sorted(p for where in attempt_dirs for p in where.glob("image_stream.rank*.json")):
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # written by rename: a partial read only happens on a file being replaced
        if not isinstance(figures, dict):
            continue
        size = figures.get("size_estimate") or 0
        if shown.get(path) == figures.get("bytes") or size <= 1 << 30:
            continue
        shown[path] = figures.get("bytes")
        state = f"done ({figures.get('action_taken')})" if figures.get("done") else "streaming"
        lines.append(
            f"image stream on {figures.get('node')} (rank {figures.get('rank')}): {state}, "
            f"{(figures.get('bytes') or 0) / 1e9:.2f} of ~{size / 1e9:.2f} GB, {figures.get('rate_mb_s')} MB/s"
        )
    return lines


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

    Progress: SLURM's job state, one line per finished pipeline task with each node's outcome, each node's
    verdict as its status.json appears. Ends when the job has ended and its last attempt's record exists (SLURM
    keeps a requeued job's ID; ``Restarts`` counts its attempts), or when the collect job has ended without one
    (an unrecorded result: ``recorded`` False). ``on_log_line`` (submit --follow) gets every rank's new log
    lines at each poll, prefixed ``node3 r2 | `` (job_view.NodeLogs; ``colour`` on a terminal). A job submitted
    with retries is followed through its collect job's decision: when it resubmitted the job without some nodes,
    the new job is followed to its end in turn (its result is returned; ``retries`` names every attempt).
    """
    while True:
        result = _follow(
            submission, on_progress=on_progress, poll_interval=poll_interval, on_log_line=on_log_line, colour=colour
        )
        retried_as = _retry_decision(submission, on_progress, poll_interval)
        if retried_as is None:
            # Read again: the collect job may have added the attempts (``retries``) to the record since.
            recorded = result.recorded
            return (
                job_result(submission.results_dir, submission.job_id, result.rc, attempt=result.attempt)
                if recorded
                else result
            )
        submission = retried_as


def _retry_decision(
    submission: Submission, on_progress: Callable[[str], None], poll_interval: float
) -> Submission | None:
    """For a job submitted with retries: wait for its collect job's decision; the retry's Submission, if any."""
    from slurm_multi.retry import read_retry_plan

    plan = read_retry_plan(submission.private_dir) or {}
    if not (plan.get("retries") or plan.get("node_selection")):
        return None
    # The collect job adds the retry decision and the node selection to the record: the result shows them.
    while _state(_job_info(submission.collect_job_id)) in ACTIVE_JOB_STATES:
        time.sleep(poll_interval)
    try:
        record = load_record(str(submission.results_dir), submission.job_id) or {}
    except INPUT_ERRORS as exc:
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
    *,
    on_progress: Callable[[str], None] = print,
    poll_interval: float = 2.0,
    on_log_line: Callable[[str], None] | None = None,
    colour: bool = False,
) -> RunResult:
    """One job of `wait`, followed to its record (or to its collect job ending without one)."""
    from slurm_multi.job_view import NodeLogs, job_nodelist

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
    output = _OutputFollower(submission.output)
    seen_statuses: set = set()
    streams_shown: dict = {}
    preflight_shown: set = set()
    last_state = None
    while True:
        info = _job_info(submission.job_id)
        state = _state(info)
        if state and state != last_state:
            where = f" on {info.get('NodeList')}" if state == "RUNNING" else ""
            why = f" ({info.get('Reason')})" if info.get("Reason") not in (None, "None") else ""
            on_progress(f"job {submission.job_id}: {state}{where}{why}")
            last_state = state
        for line in output.new_lines():
            progress.feed_output_line(line)
        attempt = _attempt(info)
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
        for line in image_stream_lines([attempt_dir, *sweep_dirs], streams_shown):
            on_progress(line)
        show_logs([attempt_dir, *sweep_dirs])
        job_over = state not in ACTIVE_JOB_STATES
        # The last attempt's own record: a requeued job's earlier record does not stand for its last run.
        record_file = Path(record_path(str(submission.results_dir), submission.job_id, attempt or 0))
        if job_over and record_file.is_file():
            break
        if job_over and _state(_job_info(submission.collect_job_id)) not in ACTIVE_JOB_STATES:
            break
        # Following the logs reads the shared files more often than SLURM is asked: lines show within 0.5 s.
        slices = max(1, int(poll_interval / LOG_POLL_INTERVAL)) if on_log_line is not None else 1
        for _ in range(slices):
            time.sleep(poll_interval / slices)
            show_logs([attempt_dir, *sweep_dirs])
    for line in output.new_lines():
        progress.feed_output_line(line)
    show_logs(list(node_logs), final=True)
    progress.task_finished()
    missing_reason = (
        f"job {submission.job_id} ended ({state or 'state unknown'}) and its collect job "
        f"{submission.collect_job_id} wrote no record for attempt {attempt or 0}: see "
        f"{submission.private_dir}/collect-*.out"
    )
    return job_result(submission.results_dir, submission.job_id, _exit_code(info), missing_reason, attempt=attempt)


# ---------------------------------------------------------------------------------------------------------------
# The afterany collect job


def _model_card(job_vars: Mapping[str, Any], root: Path) -> dict[str, Any]:
    tags = list(job_vars.get("model_tags") or [])
    models_file = job_vars.get("models_file") or str(root / "models" / "models.json")
    try:
        cards = select_model_cards(load_model_cards(models_file), tags)
    except (ManifestError, OSError, ValueError):
        cards = []
    return dict(cards[0]) if len(cards) == 1 else {"name": ",".join(tags)}


def record_job_end(job_id: str, vars_file: str | Path, *, root: Path | None = None) -> RunResult:
    """What the afterany collect job does once job ``job_id`` has ended, whatever its end.

    When the job left no record, writes a FAILURE record with SLURM's own view (``JobState``: CANCELLED,
    TIMEOUT, NODE_FAIL, ...; its ``Reason``), keeping whatever its nodes left as evidence; then regenerates
    perf.csv. A job submitted with retries is resubmitted without the nodes its failure is attributable to while
    retries remain (slurm_multi.retry, which adds ``retries`` to its record). The job's secrets and credentials files
    stay for a requeued attempt (`forget_secrets_of_forgotten_jobs` removes them once SLURM has forgotten the job).
    """
    from slurm_multi.retry import retry_after_job_end

    root = content_root(root)
    job_vars = read_job_vars(Path(vars_file))
    results_dir = str(Path(job_vars.get("results_dir") or default_results_dir()))
    try:
        job_id = validate_job_id(job_id)
        info = sbatch.job_info(job_id)
        state = _state(info)
        if state in ACTIVE_JOB_STATES:
            raise SlurmMultiError(f"job {job_id} is still {state}: record its end after it has ended")
        # SLURM keeps a requeued job's ID: record its last attempt (Restarts), else the last one on disk.
        attempt = _attempt(info)
        if attempt is None:
            attempt = job_layout.latest_attempt(results_dir, job_id)
        if load_record(results_dir, job_id, attempt) is None:
            nodelist = (info or {}).get("NodeList", "")
            nodes = expand_nodelist(nodelist) if nodelist and not nodelist.startswith("(") else []
            slurm_reason = (info or {}).get("Reason", "None")
            slurm_state = state or "UNKNOWN (SLURM forgot the job)"
            reason = "the job ended without writing its record"
            if slurm_reason not in ("", "None"):
                reason += f"; SLURM's reason: {slurm_reason}"
            if read_sweep_plan(results_dir, job_id, attempt):
                # A sweep cut short: each model without a record gets a FAILURE one, the sweep's names them all.
                record_sweep(results_dir, job_id, attempt, nodes=nodes, failure_reason=reason, slurm_state=slurm_state)
            else:
                write_failure_record(
                    results_dir,
                    job_id,
                    reason,
                    slurm_state=slurm_state,
                    model=_model_card(job_vars, root),
                    nodes=nodes,
                    attempt=attempt,
                )
        regenerate_perf_csv(results_dir)
        retry_after_job_end(results_dir, job_id, attempt, Path(vars_file).parent)
    except INPUT_ERRORS as exc:
        raise SlurmMultiError(str(exc)) from None
    finally:
        # Not this job's: `scontrol requeue` may run it again while SLURM remembers it, and its next attempt reads
        # them. Those of earlier jobs that SLURM has forgotten go now.
        forget_secrets_of_forgotten_jobs()
    return job_result(results_dir, job_id, _exit_code(info), attempt=attempt)


def forget_secrets_of_forgotten_jobs() -> list[Path]:
    """Remove the secrets and credentials files of earlier submissions whose every job (the job, its collect job,
    its retries) SLURM has forgotten (MinJobAge after its end): only then can none be requeued and read them again.

    Run by every `submit` and every afterany collect job; returns the files removed.
    """
    removed = []
    for private_dir in sorted(private_jobs_dir().glob("*")):
        held = [
            path for path in (private_dir / SECRETS_FILE_NAME, private_dir / CREDENTIALS_FILE_NAME) if path.exists()
        ]
        job_ids = _submission_job_ids(private_dir) if held else []
        # No submission file: a submission under way (or one whose sbatch failed, which removed its files itself).
        if not job_ids or any(sbatch.job_info(job_id) is not None for job_id in job_ids):
            continue
        for path in held:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _submission_job_ids(private_dir: Path) -> list[str]:
    from slurm_multi.retry import read_retry_plan

    try:
        submitted = json.loads((private_dir / SUBMISSION_FILE_NAME).read_text())
        plan = read_retry_plan(private_dir) or {}
    except (OSError, ValueError, SlurmMultiError):
        return []  # unreadable: its files stay, rather than go while a job may still read them
    retried = [entry.get("retried_as") or {} for entry in plan.get("attempts") or [] if isinstance(entry, dict)]
    ids = [submitted.get("job_id"), submitted.get("collect_job_id")]
    ids += [retry.get(name) for retry in retried for name in ("job_id", "collect_job_id")]
    return [str(job_id) for job_id in ids if job_id]
