"""`slurm-multi report`: the perf table of a results dir, and its comparison with a reference perf.csv.

Comparison: for each model of the reference (its last row, as perf.csv lists jobs oldest first), the relative
change of the latest result, ``(current - reference) / reference``. A model fails when it got worse by more than
the tolerance, when its latest run failed or has no figure, when its metric changed, or when it has no result.
"Worse" is lower for rates and throughputs, higher for times: a metric is a time when it names a time unit or
latency (``ms``, ``s``, ``seconds``, ``latency``, ``ttft``...) and no rate (``/``, ``per``); see `lower_is_better`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

TABLE_COLUMNS = ("model", "nnodes", "n_gpus", "performance", "metric", "status")
REQUIRED_COLUMNS = ("model", "performance", "metric")
PASS, FAIL, NEW = "PASS", "FAIL", "NEW"
_TIME_TOKENS = frozenset(
    (
        "ms",
        "s",
        "sec",
        "secs",
        "second",
        "seconds",
        "us",
        "ns",
        "min",
        "minutes",
        "h",
        "hours",
        "latency",
        "time",
        "duration",
        "ttft",
        "tpot",
        "itl",
        "e2el",
    )
)


class ReportError(Exception):
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


def _number(value: str) -> float | None:
    try:
        number = float(str(value).replace(",", ""))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _latest_by_model(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop_duplicates(subset="model", keep="last").set_index("model", drop=False)


def _judge(reference: pd.Series, current: pd.Series | None, tolerance: float) -> dict:
    row = {
        "model": reference["model"],
        "metric": reference["metric"],
        "reference": reference["performance"],
        "current": "",
        "change": "",
        "result": FAIL,
        "note": "",
    }
    ref_value = _number(reference["performance"])
    if current is None:
        row["note"] = "no result in this results dir"
        return row
    row["current"] = current["performance"]
    cur_value = _number(current["performance"])
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


def compare_with_reference(current: pd.DataFrame, reference: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """One row per model: reference and current figures, relative change, PASS/FAIL (NEW: not in the reference)."""
    latest = _latest_by_model(current)
    references = _latest_by_model(reference)
    rows = [
        _judge(ref, latest.loc[model] if model in latest.index else None, tolerance)
        for model, ref in references.iterrows()
    ]
    for model, cur in latest.iterrows():
        if model not in references.index:
            rows.append(
                {
                    "model": model,
                    "metric": cur["metric"],
                    "reference": "",
                    "current": cur["performance"],
                    "change": "",
                    "result": NEW,
                    "note": "not in the reference",
                }
            )
    return pd.DataFrame(rows, columns=["model", "metric", "reference", "current", "change", "result", "note"])


def comparison_table(comparison: pd.DataFrame) -> str:
    """The comparison as an aligned text table."""
    if comparison.empty:
        return "(nothing to compare: the reference has no rows)"
    return comparison.to_string(index=False)


def any_failed(comparison: pd.DataFrame) -> bool:
    """True when a model of the comparison failed."""
    return bool((comparison["result"] == FAIL).any()) if not comparison.empty else False
