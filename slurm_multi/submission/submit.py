"""Submitting a job: its private dir (scripts, vars, secrets), queued held with its afterany collect job
(sbatch.queue_job), and the secrets of jobs SLURM has forgotten removed."""

import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import new_private_dir, private_jobs_dir
from slurm_multi.spec import JobSpec, content_root
from slurm_multi.submission import retry, sbatch
from slurm_multi.submission.credentials import CREDENTIALS_FILE_NAME, write_credentials_copy
from slurm_multi.submission.job_vars import VARS_FILE_NAME, write_job_vars
from slurm_multi.submission.node_selection import select_nodes
from slurm_multi.submission.sbatch import SbatchError, SlurmOptions
from slurm_multi.submission.secrets import SECRETS_FILE_NAME, user_secrets, without_secrets, write_secrets_file
from slurm_multi.submission.shared_dirs import check_shared_dirs

SUBMISSION_FILE_NAME = "submission.json"
# Shown in dry runs in place of the job ID that sbatch has not given yet.
JOB_ID_PLACEHOLDER = "<job id>"


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
            f"limit --time {slurm.time} gives {limit} s: raise --time to at least {sbatch.slurm_time(total)} "
            f"({math.ceil(total / 60)} minutes) plus the build, or sweep fewer models per job"
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
    """Render the job's scripts and vars without writing or submitting anything (the checks `submit` makes first
    refuse what it would refuse)."""
    slurm = slurm.with_collect_job(spec.collect_job)
    check_time_limit(spec, slurm)
    check_shared_dirs(spec)
    spec.check_node_count(slurm.nodes)
    root = content_root(root)
    private_dir = Path(private_dir) if private_dir else private_jobs_dir() / "<submission>"
    secrets = user_secrets(os.environ)
    secrets_file = private_dir / SECRETS_FILE_NAME if secrets else None
    credentials_copy = private_dir / CREDENTIALS_FILE_NAME if spec.credentials_file else None
    vars_file = private_dir / VARS_FILE_NAME
    ansible_playbook = sbatch.find_ansible_playbook()
    try:
        job_script = sbatch.render_job_script(
            slurm, root, ansible_playbook, vars_file, private_dir, spec.results_dir, spec.mode, bool(spec.sweep)
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
    `private_jobs_dir`; sbatch gets this process's environment without ``MAD_SECRETS_*``. The job is queued held
    until its collect job is queued too, so that no job runs without the job that records it. ``retries``: how often
    the collect job may resubmit the job without the nodes a failure is attributable to (never for a model failure).
    ``preflight``: check the candidate nodes first and submit on healthy ones, reporting to ``on_progress``.
    The collect job's request comes from the spec's collect_job settings (`SlurmOptions.with_collect_job`).
    """
    slurm = slurm.with_collect_job(spec.collect_job)
    check_time_limit(spec, slurm)
    check_shared_dirs(spec)
    retries = retry.checked_retries(retries)
    root = content_root(root)
    selection = None
    if preflight:
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
        node_selection = selection.as_record() if selection else None
        retry.write_retry_plan(
            private_dir, retries, slurm, spec.mode, bool(spec.sweep), spec.results_dir, root, node_selection
        )
        queued = sbatch.queue_job(slurm, root, private_dir, spec.results_dir, spec.mode, bool(spec.sweep), environment)
    except BaseException as exc:
        # Whatever failed (sbatch refused, a template error, Ctrl-C), no job will read the secrets: they go now.
        # Nothing queued: the whole private dir goes. A job queued held: queue_job cancelled it, its scripts stay.
        if not isinstance(exc, sbatch.QueueError) or exc.job_id is None:
            shutil.rmtree(private_dir, ignore_errors=True)
        else:
            for private_file in (secrets_file, credentials_copy):
                if private_file:
                    private_file.unlink(missing_ok=True)
        if isinstance(exc, (SbatchError, sbatch.QueueError)):
            raise SlurmMultiError(str(exc)) from None
        raise
    job_id, collect_job_id = queued
    submission = Submission(job_id, collect_job_id, spec.results_dir, private_dir)
    submitted = {"job_id": job_id, "collect_job_id": collect_job_id, "results_dir": str(spec.results_dir)}
    submitted["output"] = str(submission.output)
    (private_dir / SUBMISSION_FILE_NAME).write_text(json.dumps(submitted, indent=2) + "\n")
    return submission


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
    try:
        submitted = json.loads((private_dir / SUBMISSION_FILE_NAME).read_text())
        plan = retry.read_retry_plan(private_dir) or {}
    except (OSError, ValueError, SlurmMultiError):
        return []  # unreadable: its files stay, rather than go while a job may still read them
    retried = [entry.get("retried_as") or {} for entry in plan.get("attempts") or [] if isinstance(entry, dict)]
    ids = [submitted.get("job_id"), submitted.get("collect_job_id")]
    ids += [retry.get(name) for retry in retried for name in ("job_id", "collect_job_id")]
    return [str(job_id) for job_id in ids if job_id]
