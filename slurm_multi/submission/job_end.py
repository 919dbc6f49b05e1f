"""The afterany collect job (`slurm-multi job-end`): a job's end recorded whatever it was, then its retry."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    load_model_cards,
    select_model_cards,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import effective_settings
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import write_failure_record
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import (
    read_sweep_plan,
    record_sweep,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import (
    load_record,
    regenerate_perf_csv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import default_results_dir
from slurm_multi.reports.job_view import job_nodelist
from slurm_multi.run_result import RunResult, job_result
from slurm_multi.spec import content_root
from slurm_multi.submission import sbatch
from slurm_multi.submission.job_vars import read_job_vars
from slurm_multi.submission.retry import retry_after_job_end
from slurm_multi.submission.submit import forget_secrets_of_forgotten_jobs


def _model_card(job_vars: Mapping[str, Any], root: Path) -> dict[str, Any]:
    tags = list(job_vars.get("model_tags") or [])
    models_file = job_vars.get("models_file") or str(root / "models" / "models.json")
    try:
        cards = select_model_cards(load_model_cards(models_file), tags)
    except (ManifestError, OSError, ValueError):
        cards = []
    return dict(cards[0]) if len(cards) == 1 else {"name": ",".join(tags)}


def _container_runtime(job_vars: Mapping[str, Any]) -> str:
    """The runtime the job was given (its -e, else the site's and the user's settings files, else the default), which
    its record names when no node's status.json does; "" when the settings cannot be read any more."""
    try:
        settings = {name: value for name, value, _ in effective_settings(job_vars)}
    except (UserError, OSError, ValueError):
        return str(job_vars.get("container_runtime") or "")
    return str(settings.get("container_runtime") or "")


def record_job_end(job_id: str, vars_file: str | Path, *, root: Path | None = None) -> RunResult:
    """What the afterany collect job does once job ``job_id`` has ended, whatever its end: a FAILURE record with
    SLURM's view (``JobState``, ``Reason``) when the job left none, perf.csv regenerated, then the job's retry
    (slurm_multi.submission.retry). The job's secrets stay for a requeued attempt until SLURM forgets the job."""
    root = content_root(root)
    job_vars = read_job_vars(Path(vars_file))
    results_dir = str(Path(job_vars.get("results_dir") or default_results_dir()))
    try:
        job_id = job_layout.validate_job_id(job_id)
        info = sbatch.job_info(job_id)
        state = sbatch.job_state(info)
        if state in sbatch.ACTIVE_JOB_STATES:
            raise SlurmMultiError(f"job {job_id} is still {state}: record its end after it has ended")
        # SLURM keeps a requeued job's ID: record its last attempt (Restarts), else the last one on disk.
        attempt = sbatch.job_attempt(info)
        if attempt is None:
            attempt = job_layout.latest_attempt(results_dir, job_id)
        if load_record(results_dir, job_id, attempt) is None:
            nodes = job_nodelist(info)
            slurm_reason = (info or {}).get("Reason", "None")
            slurm_state = state or "UNKNOWN (SLURM forgot the job)"
            reason = "the job ended without writing its record"
            if slurm_reason not in ("", "None"):
                reason += f"; SLURM's reason: {slurm_reason}"
            if read_sweep_plan(results_dir, job_id, attempt):
                # A sweep cut short: each model without a record gets a FAILURE one, the sweep's names them all.
                record_sweep(
                    results_dir,
                    job_id,
                    attempt,
                    nodes=nodes,
                    failure_reason=reason,
                    slurm_state=slurm_state,
                    container_runtime=_container_runtime(job_vars),
                )
            else:
                write_failure_record(
                    results_dir,
                    job_id,
                    reason,
                    slurm_state=slurm_state,
                    model=_model_card(job_vars, root),
                    nodes=nodes,
                    attempt=attempt,
                    container_runtime=_container_runtime(job_vars),
                )
        regenerate_perf_csv(results_dir)
        retry_after_job_end(results_dir, job_id, attempt, Path(vars_file).parent)
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    finally:
        # Not this job's: `scontrol requeue` may run it again while SLURM remembers it, and its next attempt reads
        # them. Those of earlier jobs that SLURM has forgotten go now.
        forget_secrets_of_forgotten_jobs()
    return job_result(results_dir, job_id, sbatch.job_exit_code(info), attempt=attempt)
