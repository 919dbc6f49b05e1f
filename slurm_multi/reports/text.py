"""`slurm-multi report`: the perf table of a results dir, and its comparison with a baseline.

For each model of the reference, the relative change of the latest result, ``(current - reference) / reference``.
A model fails when it got worse by more than the tolerance (lower for rates, higher for times: `lower_is_better`),
when its latest run failed or has no figure, when its metric changed, or when it has no result. A baseline
(`parse_baseline`) is a reference CSV, another job's rows, or ``last:N``: per model, the median figure of the last N
successful runs recorded before the run compared, from the history of every job record (`history_frame`).
"""

import math
import os
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import performance_figure
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

TABLE_COLUMNS = ("model", "nnodes", "n_gpus", "performance", "metric", "status")
REQUIRED_COLUMNS = ("model", "performance", "metric")
PASS, FAIL, NEW = "PASS", "FAIL", "NEW"
_TIME_TOKENS = frozenset((
    "ms", "s", "sec", "secs", "second", "seconds", "us", "ns", "min", "minutes", "h", "hours",
    "latency", "time", "duration", "ttft", "tpot", "itl", "e2el",
))  # fmt: skip


class ReportError(UserError):
    """A perf file or a tolerance that cannot be used, with what is wrong."""


def read_perf_csv(path: str | Path) -> pd.DataFrame:
    """A perf.csv (MAD's columns, or any CSV with model, performance, metric) as a frame of strings."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist: no job has been recorded there yet") from None
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise ReportError(f"cannot read {path} as CSV: {str(exc).strip()}") from None
    frame.columns = [str(name).strip() for name in frame.columns]
    missing = [name for name in REQUIRED_COLUMNS if name not in frame.columns]
    if missing:
        raise ReportError(
            f"{path} lacks the column(s) {', '.join(missing)}; a perf CSV needs {', '.join(REQUIRED_COLUMNS)}"
        )
    return frame.apply(lambda column: column.str.strip())


def perf_table(frame: pd.DataFrame) -> str:
    """The perf rows as an aligned text table (model, nodes, GPUs, figure, metric, status)."""
    if frame.empty:
        return "(no performance rows)"
    columns = [name for name in TABLE_COLUMNS if name in frame.columns]
    return frame[columns].fillna("").astype(str).to_string(index=False)


def parse_tolerance(text: str | float) -> float:
    """A tolerance as a fraction: ``0.05`` or ``5%``; negative or non-numbers refused."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ReportError(f"tolerance {text!r} is not a number: give a fraction (0.05) or a percentage (5%)") from None
    if not math.isfinite(value) or value < 0:
        raise ReportError(f"tolerance {text!r} must be 0 or more")
    return value


def lower_is_better(metric: str) -> bool:
    """True for times and latencies (``ms``, ``step_time_s``, ``latency``), False for rates (``tokens/sec``)."""
    text = str(metric).lower()
    tokens = set(re.split(r"[^a-z0-9]+", text)) - {""}
    if "/" in text or "per" in tokens:
        return False
    return bool(tokens & _TIME_TOKENS)


def parse_figure(value: str) -> float | None:
    """A perf figure by the one rule a run's results follow (perf_lines.figure_problem: plain positive finite
    decimal; "1,234.5" too, as a log line may print it); None when it is none."""
    return performance_figure(str(value).replace(",", ""))


def _latest_by_model(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop_duplicates(subset="model", keep="last").set_index("model", drop=False)


def _judge(reference: pd.Series, current: pd.Series | None, tolerance: float) -> dict:
    """The comparison's row of one model of the reference (a column it leaves out is empty)."""
    row = dict(model=reference["model"], metric=reference["metric"], reference=reference["performance"], result=FAIL)
    ref_value = parse_figure(reference["performance"])
    if current is None:
        row["note"] = "no result in this results dir"
        return row
    row["current"] = current["performance"]
    cur_value = parse_figure(current["performance"])
    if current.get("status", "SUCCESS") not in ("", "SUCCESS"):
        row["note"] = f"the latest run is {current.get('status')}"
    elif cur_value is None:
        row["note"] = "the latest run has no performance figure"
    elif current["metric"] != reference["metric"]:
        row["note"] = f"metric changed from {reference['metric']!r} to {current['metric']!r}"
    elif ref_value is None:
        row["note"] = "the reference has no performance figure"
    else:
        change = (cur_value - ref_value) / abs(ref_value) if ref_value else (0.0 if cur_value == 0 else math.inf)
        row["change"] = f"{change:+.2%}"
        worse_by = change if lower_is_better(reference["metric"]) else -change
        if worse_by > tolerance:
            row["note"] = f"worse by {worse_by:.2%} (tolerance {tolerance:.2%})"
        else:
            row["result"] = PASS
    return row


COMPARISON_COLUMNS = ["model", "metric", "reference", "current", "change", "result", "note"]


def compare_with_reference(current: pd.DataFrame, reference: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """One row per model: reference and current figures, relative change, PASS/FAIL (NEW: not in the reference,
    and a success; a failed run not in it is FAIL).

    Where the current rows carry ``job_id`` the result names the job compared (``job``); where the reference
    carries ``baseline`` (what its figure is: a job, the median of which runs) the result repeats it.
    """
    latest = _latest_by_model(current)
    references = _latest_by_model(reference)
    rows = []
    for model, ref in references.iterrows():
        cur = latest.loc[model] if model in latest.index else None
        rows.append(_judge(ref, cur, tolerance) | _provenance(ref, cur))
    note = "not in the reference" if "baseline" not in reference.columns else "no baseline run"
    for model, cur in latest.iterrows():
        if model not in references.index:
            new = dict(model=model, metric=cur["metric"], current=cur["performance"], result=NEW, note=note)
            status = cur.get("status", "SUCCESS")
            if status not in ("", "SUCCESS"):
                # Nothing to compare with, but a failed run is no new figure: a CI gate must not pass it.
                new.update(result=FAIL, note=f"the latest run is {status}; {note}")
            rows.append(new | _provenance(None, cur))
    columns = (["job"] if "job_id" in current.columns else []) + COMPARISON_COLUMNS
    columns += ["baseline"] if "baseline" in reference.columns else []
    return pd.DataFrame([{name: row.get(name, "") for name in columns} for row in rows], columns=columns)


def _provenance(reference: pd.Series | None, current: pd.Series | None) -> dict:
    found = {}
    if current is not None and "job_id" in current.index:
        found["job"] = current["job_id"]
    if reference is not None and "baseline" in reference.index:
        found["baseline"] = reference["baseline"]
    return found


def comparison_table(comparison: pd.DataFrame) -> str:
    """The comparison as an aligned text table."""
    if comparison.empty:
        return "(nothing to compare: the reference has no rows)"
    return comparison.to_string(index=False)


def any_failed(comparison: pd.DataFrame) -> bool:
    """True when a model of the comparison failed."""
    return bool((comparison["result"] == FAIL).any()) if not comparison.empty else False


# --- History and baselines --------------------------------------------------------------------------------------------

HISTORY_COLUMNS = ["job_id", "recorded_at", "job_status", "model", "metric", "performance", "status", "nnodes", "value"]
# What `report --compare` and the HTML report compare with when no baseline is given.
DEFAULT_BASELINE = "last:5"
_LAST = re.compile(r"last:(\d+)\Z")


@dataclass(frozen=True)
class Baseline:
    """What the figures are compared with: ``kind`` "file" (a reference CSV's path), "job" (that job's rows) or
    "last" (``count``: the median of the model's last successful runs)."""

    kind: str
    value: str = ""
    count: int = 0

    def describe(self) -> str:
        if self.kind == "last":
            return f"the median of each model's last {self.count} successful run(s) before it"
        return f"job {self.value}" if self.kind == "job" else self.value


def parse_baseline(text: str, results_dir: str | Path) -> Baseline:
    """``last:N``, a job ID with a record in the results dir, or a reference CSV (a name ending in .csv, a path)."""
    raw = str(text).strip()
    if raw.startswith("last"):
        match = _LAST.match(raw)
        if not match or int(match.group(1)) < 1:
            raise ReportError(f"baseline {text!r}: write last:N with N a whole number of runs, 1 or more (last:3)")
        return Baseline("last", count=int(match.group(1)))
    if raw.endswith(".csv") or os.sep in raw:
        return Baseline("file", raw)
    if raw and os.path.isfile(os.path.join(str(results_dir), "records", f"{raw}.json")):
        return Baseline("job", raw)
    if raw and os.path.isfile(raw):
        return Baseline("file", raw)
    raise ReportError(
        f"baseline {text!r} is no job recorded in {results_dir} and no file: give a job ID (records/<ID>.json), "
        "last:N (the median of the last N successful runs) or a reference perf CSV"
    )


def read_records(results_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Every job record in the results dir, and what could not be read (path: why). Sweep records included."""
    records_dir = job_layout.records_dir(str(results_dir))
    try:
        names = sorted(name for name in os.listdir(records_dir) if name.endswith(".json") and name[0] != ".")
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        raise ReportError(f"cannot list the records in {records_dir}: {exc}") from None
    records, skipped = [], []
    for name in names:
        path = os.path.join(records_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            record = safe_files.read_json_file(path)
        except (OSError, ValueError) as exc:
            skipped.append(f"{path}: {exc}")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
            skipped.append(f"{path}: not a slurm-multi record (no 'rows' list)")
            continue
        record.setdefault("job_id", name[: -len(".json")])
        records.append(record)
    return records, skipped


def _natural_key(job_id: str) -> tuple[int, str]:
    digits = re.match(r"\d+", job_id)
    return (int(digits.group()) if digits else -1, job_id)


def recorded_at(record: Mapping) -> float:
    """When the job was recorded (its record's collected_at), NaN when the record does not say."""
    value = record.get("collected_at")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def history_frame(records: Iterable[Mapping]) -> pd.DataFrame:
    """One row per job and model (the job's last row of that model), oldest recorded first (HISTORY_COLUMNS).

    ``value`` is the figure of a successful row, NaN for a failed one or one without a figure. A sweep's own
    record is left out: its models' records bring its rows.
    """
    entries = []
    for record in records:
        if "sweep" in record:
            continue
        last_rows = {}
        for row in record.get("rows") or []:
            if isinstance(row, Mapping) and str(row.get("model") or ""):
                last_rows[str(row["model"])] = row
        for model, row in last_rows.items():
            status = str(row.get("status") or "")
            value = parse_figure(row.get("performance", "")) if status in ("", "SUCCESS") else None
            entries.append(
                {
                    "job_id": str(record.get("job_id")),
                    "recorded_at": recorded_at(record),
                    "job_status": str(record.get("status") or ""),
                    "model": model,
                    "metric": str(row.get("metric") or ""),
                    "performance": str(row.get("performance") or ""),
                    "status": status,
                    "nnodes": str(row.get("nnodes") or ""),
                    "value": math.nan if value is None else value,
                }
            )
    entries.sort(key=lambda entry: (entry["recorded_at"], _natural_key(entry["job_id"])))
    # NaN sorts anywhere: a record without collected_at goes first.
    entries.sort(key=lambda entry: not math.isnan(entry["recorded_at"]))
    return pd.DataFrame(entries, columns=HISTORY_COLUMNS)


def current_runs(history: pd.DataFrame, jobs: Sequence[str] = (), model: str | None = None) -> pd.DataFrame:
    """The runs to judge: each model's newest run in the history, or its newest among ``jobs``; ``model`` only."""
    chosen = history
    if jobs:
        missing = [job for job in jobs if job not in set(history["job_id"])]
        if missing:
            raise ReportError(
                f"no recorded rows of job(s) {', '.join(missing)} in the results dir (a sweep: give its models' "
                "job IDs, <job>.<k>)"
            )
        chosen = chosen[chosen["job_id"].isin(list(jobs))]
    if model is not None:
        chosen = chosen[chosen["model"] == model]
        if chosen.empty:
            raise ReportError(f"no recorded run of model {model!r}" + (" in those jobs" if jobs else ""))
    return chosen.drop_duplicates(subset="model", keep="last").reset_index(drop=True)


def earlier_successes(history: pd.DataFrame, run: Mapping) -> pd.DataFrame:
    """The successful runs (with a figure) of the run's model recorded before it, oldest first; those with the
    run's metric when there are any."""
    model_runs = history[history["model"] == run["model"]]
    position = model_runs.index[model_runs["job_id"] == run["job_id"]]
    before = model_runs.loc[: position[0]].iloc[:-1] if len(position) else model_runs
    successes = before[before["value"].notna()]
    same_metric = successes[successes["metric"] == run["metric"]]
    return same_metric if not same_metric.empty else successes


def history_reference(history: pd.DataFrame, current: pd.DataFrame, count: int) -> pd.DataFrame:
    """Per model of ``current``, the median figure of its last ``count`` successful runs before it (a model with
    none has no reference row), with ``baseline`` saying which runs."""
    rows = []
    for _, run in current.iterrows():
        earlier = earlier_successes(history, run).tail(count)
        if earlier.empty:
            continue
        jobs = list(earlier["job_id"])
        short = f", asked for {count}" if len(jobs) < count else ""
        rows.append(
            {
                "model": run["model"],
                "metric": earlier["metric"].iloc[-1],
                "performance": f"{statistics.median(earlier['value']):.6g}",
                "status": "SUCCESS",
                "baseline": f"median of {len(jobs)} run(s){short}: job(s) {', '.join(jobs)}",
            }
        )
    return pd.DataFrame(rows, columns=["model", "metric", "performance", "status", "baseline"])


def job_reference(history: pd.DataFrame, job_id: str) -> pd.DataFrame:
    """The job's rows (one per model) as a reference, ``baseline`` naming the job."""
    rows = history[history["job_id"] == job_id]
    if rows.empty:
        raise ReportError(f"job {job_id} has a record but no perf rows to compare with")
    return rows.assign(baseline=f"job {job_id}")[["model", "metric", "performance", "status", "baseline"]]


def baseline_reference(
    history: pd.DataFrame, current: pd.DataFrame, baseline: Baseline, model: str | None = None
) -> pd.DataFrame:
    """The reference rows (model, metric, performance, status, baseline) of ``current``'s runs under ``baseline``."""
    if baseline.kind == "last":
        return history_reference(history, current, baseline.count)
    if baseline.kind == "job":
        reference = job_reference(history, baseline.value)
    else:
        reference = read_perf_csv(baseline.value).assign(baseline=baseline.value)
    return reference if model is None else reference[reference["model"] == model]


def compare_runs(
    history: pd.DataFrame,
    baseline: Baseline,
    tolerance: float,
    jobs: Sequence[str] = (),
    model: str | None = None,
) -> pd.DataFrame:
    """The comparison of the runs `current_runs` picks (each model's newest, or newest among ``jobs``) with the
    baseline's reference."""
    current = current_runs(history, jobs, model)
    reference = baseline_reference(history, current, baseline, model)
    return compare_with_reference(current.drop(columns="value"), reference, tolerance)


def validate_job_ids(jobs: Iterable[str]) -> None:
    """Refuse a job ID that is none (it names files under the results dir: ``../x`` must not reach elsewhere)."""
    for job in jobs:
        try:
            job_layout.validate_job_id(job)
        except job_layout.JobLayoutError as exc:
            raise ReportError(str(exc)) from None


def regression_threshold(reference: float, tolerance: float, metric: str) -> float:
    """The figure beyond which a run fails against ``reference``: below it for rates, above it for times."""
    margin = tolerance * abs(reference)
    return reference + margin if lower_is_better(metric) else reference - margin
