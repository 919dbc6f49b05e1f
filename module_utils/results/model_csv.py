"""A model's multiple-results CSVs: reading them, and ranking every node's candidate by its performance cells that hold
a figure (any rank may have written the full table). Controller side only (pandas)."""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import performance_figure
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

if TYPE_CHECKING:
    import pandas as pd

RESULTS_CSV_COLUMNS = ("model", "performance", "metric")
# utf-8-sig reads a file with or without the byte-order mark a spreadsheet writes; plain utf-8 would keep it in the
# first column's name ("\ufeffmodel"), which then reads as a missing column.
CSV_ENCODING = "utf-8-sig"


def pandas():
    """The pandas module, imported on first use: a job without results CSVs (most) never pays its second of
    start-up. A JobLayoutError (the user's to fix) when this interpreter cannot import it."""
    try:
        import pandas as pd
    except ImportError as exc:  # the node-side interpreter may lack pandas; only the controller needs it
        raise JobLayoutError(
            f"pandas is not importable by this Python ({exc}); collect results with the slurm-multi venv "
            "interpreter (ansible_python_interpreter for localhost)"
        ) from None
    return pd


class MalformedResultsCsv(UserError):
    """A results CSV that cannot be used; the message says why."""


def _read_results_csv_header(path: str) -> List[str]:
    """The header's column names, stripped; a column without a name is "" (a header's trailing commas)."""
    try:
        with open(path, newline="", encoding=CSV_ENCODING) as handle:
            # skipinitialspace, as pandas reads the cells: `"model", "performance"` names model and performance.
            header = next(csv.reader(handle, skipinitialspace=True), None)
    except UnicodeDecodeError as exc:
        raise MalformedResultsCsv(f"not UTF-8 text ({exc.reason})") from None
    except (OSError, csv.Error) as exc:
        raise MalformedResultsCsv(f"unreadable: {exc}") from None
    if not header:
        raise MalformedResultsCsv("empty file, no header row")
    names = [name.strip() for name in header]
    missing = [name for name in RESULTS_CSV_COLUMNS if name not in names]
    if missing:
        raise MalformedResultsCsv(
            f"missing column(s) {', '.join(missing)}; the header is {names} and a results CSV needs "
            f"{', '.join(RESULTS_CSV_COLUMNS)}"
        )
    duplicates = sorted({name for name in names if name and names.count(name) > 1})
    if duplicates:
        raise MalformedResultsCsv(f"duplicate column(s) {', '.join(duplicates)}")
    return names


def _count_performance_cells(path: str, header: List[str]) -> Tuple[int, int]:
    # Only the performance column is read: ranking 64 large CSVs must not build 64 whole frames. A cell counts when
    # it holds a figure (perf_lines.performance_figure): a CSV of "N/A" never beats a log's performance line.
    pd = pandas()
    try:
        column = pd.read_csv(
            path,
            usecols=[header.index("performance")],
            dtype=object,
            na_filter=False,
            skipinitialspace=True,
            index_col=False,
            encoding=CSV_ENCODING,
        ).iloc[:, 0]
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise MalformedResultsCsv(f"unparsable: {str(exc).strip()}") from None
    return len(column), sum(1 for value in column.tolist() if performance_figure(value) is not None)


def read_results_csv(path: str) -> pd.DataFrame:
    """A multiple-results CSV as a frame of strings, header and cells whitespace-stripped, extra columns kept and
    columns without a name left out; MalformedResultsCsv saying why the file cannot be used."""
    pd = pandas()
    names = _read_results_csv_header(path)
    try:
        # index_col=False: a trailing comma on every data row must not make the first column the index and move
        # every figure one column over.
        frame = pd.read_csv(
            path, dtype=object, na_filter=False, skipinitialspace=True, index_col=False, encoding=CSV_ENCODING
        )
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise MalformedResultsCsv(f"unparsable: {str(exc).strip()}") from None
    if len(frame.columns) != len(names):
        raise MalformedResultsCsv(f"unparsable: pandas reads {len(frame.columns)} columns in the header {names}")
    # The header's own names, by position (pandas calls an unnamed column "Unnamed: 3"); unnamed ones are dropped.
    frame.columns = names
    frame = frame[[name for name in names if name]]
    # Short rows leave NaN behind even without NA parsing; a missing cell is an empty one.
    return frame.fillna("").apply(lambda column: column.str.strip())


def load_best_results_csv(
    paths: Sequence[str], without_figures: bool = False
) -> Tuple[Optional[pd.DataFrame], Optional[str], List[Dict]]:
    """`select_best_results_csv`, with the chosen CSV already read: ``(frame or None, path or None, report)``; with
    ``without_figures`` and no figure anywhere, the CSV with the most rows (each row then says what its cell held)."""
    report = []  # type: List[Dict[str, Any]]
    for path in paths:
        entry = {"path": str(path), "rows": 0, "non_empty_rows": 0, "selected": False, "skipped": None}
        try:
            entry["rows"], entry["non_empty_rows"] = _count_performance_cells(path, _read_results_csv_header(path))
        except MalformedResultsCsv as exc:
            entry["skipped"] = str(exc)
        report.append(entry)

    # sorted() is stable: equal counts keep the callers' order (nodes in rank order).
    ranked = sorted(
        (entry for entry in report if entry["skipped"] is None and entry["non_empty_rows"] > 0),
        key=lambda entry: (entry["non_empty_rows"], entry["rows"]),
        reverse=True,
    )
    if not ranked and without_figures:
        ranked = sorted(
            (entry for entry in report if entry["skipped"] is None and entry["rows"] > 0),
            key=lambda entry: entry["rows"],
            reverse=True,
        )
    for entry in ranked:
        try:
            frame = read_results_csv(entry["path"])
        except MalformedResultsCsv as exc:
            entry["skipped"] = str(exc)
            continue
        entry["selected"] = True
        return frame, entry["path"], report
    return None, None, report


def select_best_results_csv(paths: Sequence[str]) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """``(best path or None, report)``: the candidate with the most rows whose performance is a figure (ties: more rows,
    then order). The report per path: ``path``, ``rows``, ``non_empty_rows``, ``selected`` and ``skipped`` (why)."""
    _, best_path, report = load_best_results_csv(paths)
    return best_path, report
