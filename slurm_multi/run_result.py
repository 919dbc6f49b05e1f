"""A job's outcome as the API returns it, read from the job's record."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SKIPPED, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import load_record, record_path
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class RunResult:
    """A job's outcome: its verdict, each node's verdict, the perf rows and where its artifacts are.

    ``recorded`` is False when the job (or the attempt asked for) left no record (an infrastructure failure: the
    reason says why); ``rc`` is the pipeline's exit code (0 only on SUCCESS or SKIPPED). SLURM keeps a requeued
    job's ID: ``attempt`` is the attempt this result is of (SLURM_RESTART_COUNT), ``attempts`` summarizes every
    recorded one. ``sweep`` is a sweep's models (each: index, job_id, model, status, reason); empty otherwise.
    """

    job_id: str
    status: str
    reason: str
    rc: int
    per_node: dict[str, dict[str, Any]]
    perf: "pd.DataFrame"
    results_dir: Path
    job_dir: Path
    record_json: Path | None
    record_csv: Path | None
    recorded: bool
    metric_source: str = ""
    attempt: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    # A job submitted with retries: each attempt so far, as the collect job decided it (results/retry_cause.py).
    retries: list[dict[str, Any]] = field(default_factory=list)
    # A job submitted with --preflight: {"checked": {node: problems}, "chosen": [...], "left_out": [...]}.
    node_selection: dict[str, Any] = field(default_factory=dict)

    @property
    def attempt_dir(self) -> Path:
        """This attempt's results: ``<job_dir>/attempt-<N>/`` (nodes' logs, status files, diagnostics)."""
        return Path(job_layout.attempt_dir(str(self.results_dir), self.job_id, self.attempt))


def job_result(
    results_dir: str | Path,
    job_id: str,
    rc: int | None = None,
    missing_reason: str = "the job left no record",
    attempt: int | None = None,
) -> RunResult:
    """The result of a job from its record in ``results_dir`` (a FAILURE, not recorded, when there is none).

    With ``attempt``, that attempt must have its own record: an earlier attempt's does not stand for it.
    """
    import pandas as pd  # here, not at the top: every CLI start would pay its import for the one call that needs it

    results_dir = Path(results_dir).absolute()
    try:
        record = load_record(str(results_dir), job_id)
        json_path = Path(record_path(str(results_dir), job_id))
        if attempt is not None and load_record(str(results_dir), job_id, attempt) is None:
            record = None
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    recorded = record is not None
    record = record if recorded else {"reason": missing_reason, "attempt": attempt}
    status = record.get("status", FAILURE)
    if rc is None:
        rc = (0 if status in (SUCCESS, SKIPPED) else 1) if recorded else 2
    csv_path = json_path.with_suffix(".csv")
    return RunResult(
        job_id=job_id,
        status=status,
        reason=record.get("reason", ""),
        rc=rc,
        per_node=record.get("per_node") or {},
        perf=pd.DataFrame.from_records(record.get("rows") or []),
        results_dir=results_dir,
        job_dir=results_dir / job_id,
        record_json=json_path if recorded else None,
        record_csv=csv_path if recorded and csv_path.is_file() else None,
        recorded=recorded,
        metric_source=record.get("metric_source", ""),
        attempt=int(record.get("attempt") or 0),
        attempts=list(record.get("attempts") or []),
        sweep=list(record.get("sweep") or []),
        retries=list(record.get("retries") or []),
        node_selection=dict(record.get("node_selection") or {}),
    )
