"""The postprocessing stage: a job's per-node results become one verdict and one perf record.

Controller side only (localhost, the venv interpreter): pandas does the tabular work.

Layout (module_utils/job_layout.py, docs/contracts.md): SLURM keeps a requeued job's ID, so each attempt
(``SLURM_RESTART_COUNT``) has its own ``<results_dir>/<job_id>/attempt-<N>/nodes/<node>/`` with ``run.log``,
``status.json`` and the multiple-results CSVs, and its own record ``records/<job_id>/attempt-<N>.json`` (the
attempt's completion marker, written last) beside its ``.csv``. The job's record ``records/<job_id>.json|.csv`` is
its last attempt's, with ``attempts`` naming every attempt; ``perf.csv`` is regenerated from the job records, so it
carries each job's last attempt only.

Writes are fresh temp files (O_EXCL | O_NOFOLLOW) renamed into place, under an exclusive ``flock`` on
``<results_dir>/perf.csv.lock``: two jobs finishing together serialize their record write and the perf.csv
regeneration, so neither loses the other's rows. A record is never overwritten unless the caller forces it,
and a file that cannot be read is reported and left in place, never deleted. A results dir or job dir that
another user owns or could write is refused (job_layout.check_directory).
"""

from __future__ import annotations

import csv
import errno
import fcntl
import json
import os
import re
import time
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ansible.module_utils import job_layout
from ansible.module_utils.job_layout import JobLayoutError, validate_job_id  # noqa: F401 - validate_job_id is API
from ansible.module_utils.perf_lines import scan_log_file

try:
    import pandas as pd
except ImportError as exc:  # the node-side interpreter may lack pandas; only the controller needs it
    pd = None
    PANDAS_IMPORT_ERROR = exc  # type: Optional[ImportError]
else:
    PANDAS_IMPORT_ERROR = None

# MAD's perf.csv, column for column: dashboards and MAD's own tools read this file.
PERF_CSV_COLUMNS = (
    "model",
    "n_gpus",
    "nnodes",
    "gpus_per_node",
    "training_precision",
    "pipeline",
    "args",
    "tags",
    "docker_file",
    "base_docker",
    "docker_sha",
    "docker_image",
    "git_commit",
    "machine_name",
    "deployment_type",
    "launcher",
    "gpu_architecture",
    "performance",
    "metric",
    "relative_change",
    "status",
    "build_duration",
    "test_duration",
    "dataname",
    "data_provider_type",
    "data_size",
    "data_download_duration",
    "build_number",
    "additional_docker_run_options",
)
RESULTS_CSV_COLUMNS = ("model", "performance", "metric")
DEPLOYMENT_TYPE = "slurm"
LAUNCHER = "slurm_multi"
SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
NO_METRIC_REASON = "no performance metric found in any node's log or CSV"
# A node_statuses value carrying this key stands for a status.json that exists but cannot be read.
STATUS_FILE_ERROR = "status_file_error"
LOCK_TIMEOUT_SECONDS = 300.0
# Node names listed in a reason before "and N more": a 64-node cancel stays one readable line.
REASON_NODES_SHOWN = 8

# Card keys whose perf.csv column has another name.
_CARD_TO_PERF_COLUMN = {"name": "model", "dockerfile": "docker_file"}


# An expected failure of collection, with a message that says what to fix. The results dir's layout errors (a bad
# job ID, a dir another user owns) are the same kind: one exception for everything the user must fix.
ResultsCollectionError = JobLayoutError


class Verdict(NamedTuple):
    """A job's verdict: SUCCESS or FAILURE, why, and each node's own verdict keyed by node name."""

    status: str
    reason: str
    per_node: Dict[str, Dict[str, Any]]


class JobCollection(NamedTuple):
    """What collecting a job produced: the record, where it lives, and whether anything on disk changed."""

    record: Dict[str, Any]
    record_path: str
    changed: bool
    perf_csv_skipped: List[Dict[str, str]]
    attempt: int = 0


class PerfCsvUpdate(NamedTuple):
    """The regenerated perf.csv: its path, row count, whether it changed, and the record files left out."""

    path: str
    rows: int
    changed: bool
    skipped: List[Dict[str, str]]


def require_pandas() -> None:
    """Raise a ResultsCollectionError when pandas is not importable by this interpreter."""
    if pd is None:
        raise ResultsCollectionError(
            "pandas is not importable by this Python ({0}); collect results with the slurm-multi venv interpreter "
            "(ansible_python_interpreter for localhost)".format(PANDAS_IMPORT_ERROR)
        )


# --------------------------------------------------------------------------------------------------------------
# Multiple-results CSVs


class MalformedResultsCsv(Exception):
    """A results CSV that cannot be used; the message says why."""


def _read_results_csv_header(path: str) -> List[str]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            header = next(csv.reader(handle), None)
    except UnicodeDecodeError as exc:
        raise MalformedResultsCsv("not UTF-8 text ({0})".format(exc.reason))
    except (OSError, csv.Error) as exc:
        raise MalformedResultsCsv("unreadable: {0}".format(exc))
    if not header:
        raise MalformedResultsCsv("empty file, no header row")
    names = [name.strip() for name in header]
    missing = [name for name in RESULTS_CSV_COLUMNS if name not in names]
    if missing:
        raise MalformedResultsCsv(
            "missing column(s) {0}; the header is {1} and a results CSV needs {2}".format(
                ", ".join(missing), names, ", ".join(RESULTS_CSV_COLUMNS)
            )
        )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise MalformedResultsCsv("duplicate column(s) {0}".format(", ".join(duplicates)))
    return names


def _count_performance_cells(path: str, header: List[str]) -> Tuple[int, int]:
    # Only the performance column is read: ranking 64 large CSVs must not build 64 whole frames. Empty cells
    # become NaN in the C parser, so an all-numeric column is counted without one Python object per cell.
    try:
        column = pd.read_csv(
            path,
            usecols=[header.index("performance")],
            keep_default_na=False,
            na_values=[""],
            skipinitialspace=True,
            encoding="utf-8",
        ).iloc[:, 0]
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise MalformedResultsCsv("unparsable: {0}".format(str(exc).strip()))
    if pd.api.types.is_numeric_dtype(column):
        return len(column), int(column.notna().sum())
    non_empty = sum(1 for value in column.tolist() if isinstance(value, str) and value.strip())
    return len(column), non_empty


def read_results_csv(path: str) -> "pd.DataFrame":
    """A multiple-results CSV as a frame of strings, header and cells whitespace-stripped, extra columns kept.

    Raises MalformedResultsCsv saying why the file cannot be used.
    """
    require_pandas()
    _read_results_csv_header(path)
    try:
        frame = pd.read_csv(path, dtype=object, na_filter=False, skipinitialspace=True, encoding="utf-8")
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise MalformedResultsCsv("unparsable: {0}".format(str(exc).strip()))
    frame.columns = [str(name).strip() for name in frame.columns]
    # Short rows leave NaN behind even without NA parsing; a missing cell is an empty one.
    return frame.fillna("").apply(lambda column: column.str.strip())


def _load_best_results_csv(paths: Sequence[str]) -> Tuple[Optional["pd.DataFrame"], Optional[str], List[Dict]]:
    require_pandas()
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
    """The candidate CSV with the most non-empty performance rows (ties: more rows, then the given order).

    Returns ``(best_path or None, report)``; the report has one entry per path: ``path``, ``rows``,
    ``non_empty_rows``, ``selected`` and ``skipped`` (None, or why the file was unusable). None when no
    candidate holds a single non-empty performance cell: an empty master CSV never beats a full worker CSV.
    """
    _, best_path, report = _load_best_results_csv(paths)
    return best_path, report


# --------------------------------------------------------------------------------------------------------------
# Verdict


def _node_failure_cause(status: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why this node failed, or None when its status shows a clean run."""
    if status is None:
        return "no status.json: its run stage never ran or the node was lost"
    if status.get(STATUS_FILE_ERROR):
        return "status.json unreadable: {0}".format(status[STATUS_FILE_ERROR])
    if status.get("aborted_by_rank") is not None:
        return "stopped because rank {0} failed".format(status["aborted_by_rank"])
    causes = []
    if status.get("cancelled"):
        causes.append("cancelled (SIGTERM: scancel, time limit or controller gone)")
    if status.get("timed_out"):
        causes.append("timed out (model timeout or end of the job's time limit)")
    exit_code = status.get("exit_code")
    if exit_code not in (None, 0):
        causes.append("container exited with code {0}".format(exit_code))
    if status.get("error_pattern"):
        causes.append("log matched error pattern {0!r}".format(status["error_pattern"]))
    if causes:
        return ", ".join(causes)
    if status.get("status") == FAILURE:
        return "node reported FAILURE: {0}".format(status.get("reason") or "no reason given")
    if exit_code is None:
        return "the container never ran (no exit code)"
    if status.get("status") != SUCCESS:
        return "status.json has an unknown status {0!r}".format(status.get("status"))
    return None


def _node_label(node: str, rank: Any) -> str:
    return "{0} (rank {1})".format(node, rank)


def _describe_groups(groups: Dict[str, List[str]]) -> List[str]:
    parts = []
    for cause, labels in groups.items():
        shown = ", ".join(labels[:REASON_NODES_SHOWN])
        if len(labels) > REASON_NODES_SHOWN:
            shown += " and {0} more".format(len(labels) - REASON_NODES_SHOWN)
        parts.append("{0}: {1}".format(shown, cause))
    return parts


def _has_metric(row: Mapping[str, Any]) -> bool:
    value = row.get("performance")
    return value is not None and str(value).strip() != ""


def _as_rank(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _nodes_in_rank_order(statuses: Mapping[str, Optional[Mapping[str, Any]]]) -> List[str]:
    return sorted(statuses, key=lambda node: (_as_rank((statuses[node] or {}).get("rank")) or 0, node))


def decide_verdict(
    node_statuses: Mapping[str, Optional[Mapping[str, Any]]],
    perf_rows: Sequence[Mapping[str, Any]],
    expected_nodes: Sequence[str],
    abort_marker: Optional[Mapping[str, Any]] = None,
) -> Verdict:
    """A job's verdict from its nodes' status.json contents and the perf rows found anywhere.

    ``node_statuses`` maps node name to its parsed status.json, None when the node left none, or a dict with
    ``STATUS_FILE_ERROR`` when it was unreadable. ``expected_nodes`` are the allocation's nodes in rank order
    (rank i is the i-th); empty means "the nodes that left a status". ``abort_marker`` is the job's ABORT file.

    Any node's real failure (non-zero exit, error pattern, abort, cancel, time limit, missing status) makes the
    job a FAILURE even when another node printed a metric; the reason names the root-cause nodes first, then the
    nodes that only stopped because another rank failed. Without a failure, one non-empty performance row from
    any node (the last rank on a worker, typically) is a SUCCESS; none at all is a FAILURE.
    """
    nodes = list(expected_nodes) or _nodes_in_rank_order(node_statuses)
    per_node = {}  # type: Dict[str, Dict[str, Any]]
    for index, node in enumerate(nodes):
        status = node_statuses.get(node)
        readable = status if status and not status.get(STATUS_FILE_ERROR) else {}
        cause = _node_failure_cause(status)
        aborted_by = _as_rank(readable.get("aborted_by_rank"))
        per_node[node] = {
            "rank": index if expected_nodes else _as_rank(readable.get("rank")),
            "status": FAILURE if cause else SUCCESS,
            "reason": cause or "",
            # A node the pipeline stopped because another node's stage failed (the play's rescue) is collateral.
            "root_cause": bool(cause) and aborted_by is None and not readable.get("stopped_by_other_node"),
            "aborted_by_rank": aborted_by,
            "perf_lines": readable.get("perf_lines", 0),
            "node_reason": readable.get("reason", ""),
        }

    # A rank that others blame (or that wrote the ABORT marker) is a root cause even when its own status is
    # missing or looks clean: its node died before it could say so.
    marker_rank = _as_rank((abort_marker or {}).get("rank"))
    blamed = {entry["aborted_by_rank"] for entry in per_node.values() if entry["aborted_by_rank"] is not None}
    if marker_rank is not None:
        blamed.add(marker_rank)
    node_by_rank = {entry["rank"]: node for node, entry in per_node.items()}
    for rank in sorted(blamed):
        node = node_by_rank.get(rank)
        if node is None or per_node[node]["root_cause"]:
            continue
        told = (abort_marker or {}).get("reason") if rank == marker_rank else None
        per_node[node].update(
            status=FAILURE,
            root_cause=True,
            reason="failed and stopped the other ranks: {0}".format(told or "see its run.log"),
        )

    root_causes = {}  # type: Dict[str, List[str]]
    collateral = {}  # type: Dict[str, List[str]]
    for node, entry in per_node.items():
        if entry["status"] == FAILURE:
            groups = root_causes if entry["root_cause"] else collateral
            groups.setdefault(entry["reason"], []).append(_node_label(node, entry["rank"]))

    has_metric = any(_has_metric(row) for row in perf_rows)
    parts = _describe_groups(root_causes) + _describe_groups(collateral)
    if not nodes:
        parts = ["no node of the job left any result"]
    if abort_marker and not parts:
        parts = ["the ABORT marker says: {0}".format(abort_marker.get("reason") or "no reason given")]
    if parts:
        if not has_metric:
            parts.append(NO_METRIC_REASON)
        return Verdict(FAILURE, "; ".join(parts), per_node)
    if not has_metric:
        return Verdict(FAILURE, NO_METRIC_REASON, per_node)
    metric_rows = sum(1 for row in perf_rows if _has_metric(row))
    return Verdict(SUCCESS, "{0} performance row(s) found, no node failed".format(metric_rows), per_node)


# --------------------------------------------------------------------------------------------------------------
# Files: atomic replace, the results lock, JSON


def _replace_file_atomically(path: str, data: bytes) -> None:
    job_layout.write_file_atomically(path, data, 0o644)


_LOCK_FIX = ("a results dir shared by several users belongs to a group they are all in (chgrp TEAM DIR && "
             "chmod 2775 DIR) and its lock file is readable by them (chmod 0664 {0})")


class _ResultsLock:
    """Exclusive flock on ``<results_dir>/perf.csv.lock``, given up after a deadline with a clear error.

    flock needs no write access on a local filesystem: the file is opened read-write when we may (NFS emulates
    flock with POSIX locks, which need it), else read-only, so a teammate's lock file in a shared results dir
    serves everyone. It is created 0664 whatever the umask, and never through a symlink.
    """

    def __init__(self, results_dir: str, timeout: float = LOCK_TIMEOUT_SECONDS) -> None:
        self.path = os.path.join(results_dir, job_layout.LOCK_FILE)
        self.timeout = timeout
        self.fd = -1

    def _open(self) -> int:
        flags = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o664)
        except FileExistsError:
            pass
        else:
            os.fchmod(fd, 0o664)
            return fd
        try:
            return os.open(self.path, os.O_RDWR | flags)
        except PermissionError:
            return os.open(self.path, os.O_RDONLY | flags)

    def _error(self, exc: OSError, doing: str) -> ResultsCollectionError:
        if exc.errno == errno.ENOLCK:
            return ResultsCollectionError(
                "cannot lock {0}: no locks available (ENOLCK). The results dir is on a filesystem mounted without "
                "lock support (NFSv3 'nolock', or no lockd/statd): remount it with locking (NFSv4, or NFSv3 with "
                "rpc.statd running), or choose a results_dir on storage with working locks (Lustre needs "
                "-o flock)".format(self.path))
        if exc.errno == errno.ELOOP:
            return ResultsCollectionError(
                "{0} is a symbolic link, which someone may have planted to redirect our writes: remove it and "
                "collect again".format(self.path))
        if exc.errno == errno.EBADF:
            return ResultsCollectionError(
                "cannot lock {0}: this filesystem (NFS) locks only files opened for writing, and the lock file is "
                "not writable by you; {1}".format(self.path, _LOCK_FIX.format(self.path)))
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ResultsCollectionError(
                "cannot {0} {1}: {2}. To collect into a results dir you must be able to read its lock file and "
                "write the dir; {3}".format(doing, self.path, exc.strerror, _LOCK_FIX.format(self.path)))
        return ResultsCollectionError("cannot {0} {1}: {2}".format(doing, self.path, exc.strerror or exc))

    def __enter__(self) -> "_ResultsLock":
        try:
            self.fd = self._open()
        except OSError as exc:
            raise self._error(exc, "open the lock file") from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise self._error(exc, "lock") from None
            if time.monotonic() >= deadline:
                os.close(self.fd)
                raise ResultsCollectionError(
                    "another process has held {0} for {1:.0f} s; if no collect is running, that process is stuck: "
                    "stop it, then collect again".format(self.path, self.timeout)
                )
            time.sleep(0.05)

    def __exit__(self, *exc_info: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _read_json_file(path: str) -> Any:
    # Never through a symlink: a link planted in a shared dir must not make us read (and keep) another file.
    return json.loads(job_layout.read_file(path).decode("utf-8"))


def _json_bytes(data: Any) -> bytes:
    # No indent: only the compact form uses json's C encoder, and a record can hold 100k rows.
    return (json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------------------------
# Records and perf.csv


def record_path(results_dir: str, job_id: str, attempt: Optional[int] = None) -> str:
    """Where the job's record lives (``attempt`` None), or one attempt's record (its completion marker)."""
    if attempt is None:
        return job_layout.job_record_path(results_dir, job_id)
    return job_layout.attempt_record_path(results_dir, job_id, attempt)


def load_record(results_dir: str, job_id: str, attempt: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The job's record (or, with ``attempt``, that attempt's), None when there is none.

    A malformed record raises: it is never replaced silently.
    """
    path = record_path(results_dir, job_id, attempt)
    try:
        record = _read_json_file(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ResultsCollectionError(
                "the record {0} is a symbolic link, which someone may have planted to make us read or overwrite "
                "another file: remove it and collect again".format(path))
        raise ResultsCollectionError(
            "the record {0} exists but cannot be read ({1}); move it aside or collect again with force".format(
                path, exc
            )
        )
    except ValueError as exc:
        raise ResultsCollectionError(
            "the record {0} exists but cannot be read ({1}); move it aside or collect again with force".format(
                path, exc
            )
        )
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise ResultsCollectionError(
            "the record {0} is not a slurm-multi record (no 'rows' list); move it aside or collect again "
            "with force".format(path)
        )
    return record


def _natural_job_key(path: str) -> Tuple[int, str]:
    name = os.path.basename(path)[: -len(".json")]
    digits = re.match(r"\d+", name)
    return (int(digits.group()) if digits else -1, name)


def _perf_csv_bytes(rows: Iterable[Mapping[str, Any]], extra_columns: Sequence[str] = ()) -> bytes:
    columns = list(PERF_CSV_COLUMNS) + [name for name in extra_columns if name not in PERF_CSV_COLUMNS]
    frame = pd.DataFrame.from_records(list(rows), columns=columns).fillna("")
    return frame.to_csv(index=False, lineterminator="\n").encode("utf-8")


def _regenerate_perf_csv_locked(results_dir: str) -> PerfCsvUpdate:
    records_dir = job_layout.records_dir(results_dir)
    try:
        # Job records only: each attempt's record sits in records/<job_id>/, a directory.
        names = [name for name in os.listdir(records_dir) if name.endswith(".json") and not name.startswith(".")
                 and os.path.isfile(os.path.join(records_dir, name))]
    except FileNotFoundError:
        names = []
    rows = []  # type: List[Mapping[str, Any]]
    skipped = []  # type: List[Dict[str, str]]
    for path in sorted((os.path.join(records_dir, name) for name in names), key=_natural_job_key):
        try:
            record = _read_json_file(path)
        except (OSError, ValueError) as exc:
            skipped.append({"path": path, "reason": "unreadable: {0}".format(exc)})
            continue
        record_rows = record.get("rows") if isinstance(record, dict) else None
        if not isinstance(record_rows, list) or not all(isinstance(row, dict) for row in record_rows):
            skipped.append({"path": path, "reason": "not a slurm-multi record: no 'rows' list of objects"})
            continue
        rows.extend(record_rows)

    perf_csv = os.path.join(results_dir, job_layout.PERF_CSV)
    data = _perf_csv_bytes(rows)
    unchanged = _file_holds(perf_csv, data)
    if not unchanged:
        _replace_file_atomically(perf_csv, data)
    return PerfCsvUpdate(perf_csv, len(rows), not unchanged, skipped)


def regenerate_perf_csv(results_dir: str) -> PerfCsvUpdate:
    """Rebuild ``perf.csv`` (MAD's 29 columns) from every record, replacing it atomically when its content changes.

    Records that cannot be read are listed in ``skipped`` and left untouched.
    """
    require_pandas()
    job_layout.check_results_dir(results_dir, create=True)
    with _ResultsLock(results_dir):
        return _regenerate_perf_csv_locked(results_dir)


def _file_holds(path: str, data: bytes) -> bool:
    try:
        return job_layout.read_file(path) == data
    except OSError:
        return False


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _load_run_context(job_dir: str) -> Dict[str, Any]:
    try:
        context = _read_json_file(os.path.join(job_dir, job_layout.RUN_CONTEXT_FILE))
    except (OSError, ValueError):
        return {}
    return context if isinstance(context, dict) else {}


def _model_name(model: Mapping[str, Any], run_context: Mapping[str, Any]) -> str:
    if model.get("name"):
        return str(model["name"])
    from_context = run_context.get("model")
    if isinstance(from_context, dict):
        return str(from_context.get("name") or "")
    return str(from_context or "")


def _common_row(
    model: Mapping[str, Any], model_name: str, nodes: Sequence[str], statuses: Mapping[str, Any]
) -> Dict[str, str]:
    row = {name: "" for name in PERF_CSV_COLUMNS}
    for key, value in model.items():
        column = _CARD_TO_PERF_COLUMN.get(key, key)
        if column in row:
            row[column] = _text(value)
    row["model"] = model_name
    row["nnodes"] = str(len(nodes))
    gpus_per_node = _text(model.get("gpus_per_node", model.get("n_gpus", "")))
    row["gpus_per_node"] = gpus_per_node
    # MAD's n_gpus is the run's total; a card's n_gpus is per node ("-1" means all, unknown here: kept as is).
    if gpus_per_node.isdigit() and int(gpus_per_node) > 0:
        row["n_gpus"] = str(int(gpus_per_node) * max(len(nodes), 1))
    else:
        row["n_gpus"] = gpus_per_node
    if not row["machine_name"] and nodes:
        row["machine_name"] = nodes[0]
    row["deployment_type"] = DEPLOYMENT_TYPE
    row["launcher"] = LAUNCHER
    started = [s["started_at"] for s in statuses.values() if isinstance(s, dict) and _is_number(s.get("started_at"))]
    ended = [s["ended_at"] for s in statuses.values() if isinstance(s, dict) and _is_number(s.get("ended_at"))]
    if started and ended and max(ended) >= min(started):
        row["test_duration"] = "{0:.2f}".format(max(ended) - min(started))
    return row


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _node_dirs(job_dir: str) -> List[str]:
    try:
        return sorted(name for name in os.listdir(os.path.join(job_dir, "nodes")) if not name.startswith("."))
    except OSError:
        return []


def _load_node_status(path: str) -> Optional[Dict[str, Any]]:
    try:
        status = _read_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {STATUS_FILE_ERROR: str(exc)}
    if not isinstance(status, dict):
        return {STATUS_FILE_ERROR: "not a JSON object"}
    return status


def _load_abort_marker(job_dir: str) -> Optional[Dict[str, Any]]:
    try:
        marker = _read_json_file(job_layout.abort_marker_path(job_dir))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"reason": "unreadable ABORT marker: {0}".format(exc)}
    return marker if isinstance(marker, dict) else {"reason": str(marker)}


def _results_csv_candidates(node_dir: str, multiple_results: str) -> List[str]:
    wanted = os.path.basename(multiple_results) if multiple_results else None
    try:
        names = sorted(os.listdir(node_dir))
    except OSError:
        return []
    return [
        os.path.join(node_dir, name)
        for name in names
        if (name == wanted if wanted else name.endswith(".csv")) and os.path.isfile(os.path.join(node_dir, name))
    ]


def _rows_from_results_csv(frame: "pd.DataFrame", common: Mapping[str, str], model_name: str) -> List[Dict]:
    table = pd.DataFrame(dict(common), index=frame.index, columns=list(PERF_CSV_COLUMNS))
    # As in MAD, the CSV's own columns win over the model card's, and a row is named "<model>_<row model>".
    for name in frame.columns:
        table[name] = frame[name]
    table["model"] = (model_name + "_" + frame["model"]) if model_name else frame["model"]
    # zip over plain lists: DataFrame.to_dict boxes every cell and is ten times slower on 100k rows.
    names = list(table.columns)
    return [dict(zip(names, cells)) for cells in zip(*(table[name].tolist() for name in names))]


class _JobEvidence(NamedTuple):
    nodes: List[str]
    statuses: Dict[str, Optional[Dict[str, Any]]]
    abort_marker: Optional[Dict[str, Any]]
    rows: List[Dict[str, str]]
    extra_columns: List[str]
    metric_source: str
    csv_report: List[Dict[str, Any]]
    log_findings: Dict[str, Dict[str, Any]]


def _gather_job(
    results_dir: str, job_id: str, attempt: int, model: Mapping[str, Any], nodes: Sequence[str]
) -> _JobEvidence:
    """Everything the attempt's nodes left, and the perf rows: the best results CSV's, else the last log line."""
    attempt_dir = job_layout.attempt_dir(results_dir, job_id, attempt)
    run_context = _load_run_context(attempt_dir)
    hosts = run_context.get("hosts")
    if not nodes and isinstance(hosts, list) and all(isinstance(host, str) for host in hosts):
        nodes = hosts
    node_dirs = {
        node: job_layout.node_dir(results_dir, job_id, attempt, node) for node in list(nodes) or _node_dirs(attempt_dir)
    }
    statuses = {
        node: _load_node_status(os.path.join(node_dir, job_layout.STATUS_FILE)) for node, node_dir in node_dirs.items()
    }
    nodes = list(nodes) or _nodes_in_rank_order(statuses)
    model_name = _model_name(model, run_context)
    common = _common_row(model, model_name, nodes, statuses)

    candidates = []  # type: List[str]
    log_findings = {}  # type: Dict[str, Dict[str, Any]]
    last_report = None
    for node in nodes:
        node_dir = node_dirs[node]
        candidates.extend(_results_csv_candidates(node_dir, _text(model.get("multiple_results"))))
        try:
            scan = scan_log_file(os.path.join(node_dir, "run.log"))
        except OSError:
            continue
        log_findings[node] = {"perf_lines": len(scan.perf_lines), "error_pattern": scan.error_pattern}
        if scan.perf_lines:
            # The last rank that reports is the conventional reporter; its last line is the final figure.
            last_report = (node, scan.perf_lines[-1])

    frame, best_csv, csv_report = _load_best_results_csv(candidates)
    if frame is not None:
        rows = _rows_from_results_csv(frame, common, model_name)
        extra_columns = [name for name in frame.columns if name not in PERF_CSV_COLUMNS]
        metric_source = os.path.relpath(best_csv, results_dir)
    elif last_report is not None:
        node, perf = last_report
        rows = [dict(common, performance=perf.raw.replace(",", ""), metric=perf.metric)]
        extra_columns = []
        metric_source = os.path.relpath(os.path.join(node_dirs[node], "run.log"), results_dir)
    else:
        rows, extra_columns, metric_source = [dict(common)], [], ""
    return _JobEvidence(
        nodes, statuses, _load_abort_marker(attempt_dir), rows, extra_columns, metric_source, csv_report, log_findings
    )


def _decide_job(
    results_dir: str, job_id: str, attempt: int, model: Mapping[str, Any], nodes: Sequence[str]
) -> Tuple[_JobEvidence, Verdict]:
    evidence = _gather_job(results_dir, job_id, attempt, model, nodes)
    metric_rows = [row for row in evidence.rows if _has_metric(row)]
    return evidence, decide_verdict(evidence.statuses, metric_rows, evidence.nodes, evidence.abort_marker)


def _build_record(
    job_id: str,
    attempt: int,
    evidence: _JobEvidence,
    status: str,
    reason: str,
    per_node: Dict[str, Dict[str, Any]],
    slurm_state: Optional[str] = None,
) -> Dict[str, Any]:
    for row in evidence.rows:
        row["status"] = SUCCESS if status == SUCCESS and _has_metric(row) else FAILURE
    for node, findings in evidence.log_findings.items():
        if node in per_node:
            per_node[node]["log"] = findings
    return {
        "job_id": job_id,
        "attempt": attempt,
        "status": status,
        "reason": reason,
        "slurm_state": slurm_state,
        "nodes": evidence.nodes,
        "per_node": per_node,
        "metric_source": evidence.metric_source,
        "abort_marker": evidence.abort_marker,
        "results_csv_candidates": evidence.csv_report,
        "extra_columns": evidence.extra_columns,
        "rows": evidence.rows,
        "collected_at": time.time(),
    }


def _check_job_dirs(results_dir: str, job_id: str, attempt: int, create: bool) -> None:
    """Refuse a results dir, job dir or attempt dir that another user owns or could write (job_layout)."""
    if not job_layout.check_results_dir(results_dir, create=create):
        return
    for path, what in ((job_layout.job_dir(results_dir, job_id), "job directory"),
                       (job_layout.attempt_dir(results_dir, job_id, attempt), "attempt directory")):
        if os.path.lexists(path):
            job_layout.check_directory(path, what)


def _summary(results_dir: str, path: str, record: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        "attempt": record.get("attempt"),
        "status": record.get("status"),
        "reason": record.get("reason"),
        "slurm_state": record.get("slurm_state"),
        "collected_at": record.get("collected_at"),
        "record": os.path.relpath(path, results_dir),
    }


def _update_job_record_locked(results_dir: str, job_id: str) -> Tuple[Optional[Dict[str, Any]], bool]:
    """The job's record rebuilt from its attempts' records: the last attempt's, with ``attempts`` naming each.

    Written (CSV first, JSON last) only when its content changed; returns ``(job record, changed)``.
    """
    summaries = []  # type: List[Dict[str, Any]]
    last = None  # type: Optional[Dict[str, Any]]
    for attempt in job_layout.attempts_recorded(results_dir, job_id):
        record = load_record(results_dir, job_id, attempt)
        if record is None:
            continue
        record.setdefault("attempt", attempt)
        summaries.append(_summary(results_dir, record_path(results_dir, job_id, attempt), record))
        last = record
    if last is None:
        return load_record(results_dir, job_id), False
    job_record = dict(last, attempts=summaries)
    path = record_path(results_dir, job_id)
    csv_data = _perf_csv_bytes(job_record["rows"], job_record.get("extra_columns") or [])
    json_data = _json_bytes(job_record)
    changed = False
    if not _file_holds(path[: -len(".json")] + ".csv", csv_data):
        _replace_file_atomically(path[: -len(".json")] + ".csv", csv_data)
        changed = True
    if not _file_holds(path, json_data):
        _replace_file_atomically(path, json_data)
        changed = True
    return job_record, changed


def _write_record_and_perf_csv(results_dir: str, record: Dict[str, Any], overwrite: bool) -> JobCollection:
    """Write the attempt's record unless it exists (or overwrite), then the job's record and perf.csv; locked."""
    job_id, attempt = record["job_id"], record["attempt"]
    path = record_path(results_dir, job_id, attempt)
    job_layout.make_job_dirs(os.path.dirname(path), results_dir)
    with _ResultsLock(results_dir):
        existing = None if overwrite else load_record(results_dir, job_id, attempt)
        if existing is None:
            # The attempt's CSV first, its JSON last: the JSON is the attempt's completion marker.
            _replace_file_atomically(
                path[: -len(".json")] + ".csv", _perf_csv_bytes(record["rows"], record["extra_columns"])
            )
            _replace_file_atomically(path, _json_bytes(record))
        _, job_record_changed = _update_job_record_locked(results_dir, job_id)
        update = _regenerate_perf_csv_locked(results_dir)
    changed = existing is None or job_record_changed or update.changed
    return JobCollection(existing or record, path, changed, update.skipped, attempt)


def _attempt_to_collect(results_dir: str, job_id: str, attempt: Optional[int]) -> int:
    return job_layout.latest_attempt(results_dir, job_id) if attempt is None else job_layout.validate_attempt(attempt)


def collect_job(
    results_dir: str,
    job_id: str,
    model: Optional[Mapping[str, Any]] = None,
    nodes: Sequence[str] = (),
    force: bool = False,
    write: bool = True,
    attempt: Optional[int] = None,
) -> JobCollection:
    """Decide an attempt's verdict from ``<results_dir>/<job_id>/attempt-<N>/nodes/*/`` and write its record.

    ``attempt`` is SLURM_RESTART_COUNT of the run (None: the job's last attempt on disk). ``model`` holds
    model-card fields (``name``, ``n_gpus``, ``tags``, ``args``, ``multiple_results``, ``dockerfile``...) and any
    perf.csv column; ``nodes`` are the allocation's nodes in rank order (default: the run context's hosts, else
    the node dirs present). The attempt's record is its completion marker: when it exists, the attempt is not
    decided again (``changed`` False unless the job's record or perf.csv had to catch up) unless ``force``.
    The job's record is then rebuilt from its attempts (the last one's, naming all) and perf.csv from the job
    records. ``write=False`` decides without touching anything (check mode).
    """
    require_pandas()
    job_id = validate_job_id(job_id)
    attempt = _attempt_to_collect(results_dir, job_id, attempt)
    _check_job_dirs(results_dir, job_id, attempt, create=write)
    load_record(results_dir, job_id)  # a job record that cannot be read is refused and kept, never replaced
    path = record_path(results_dir, job_id, attempt)
    if not force:
        existing = load_record(results_dir, job_id, attempt)
        if existing is not None:
            if not write:
                return JobCollection(existing, path, False, [], attempt)
            with _ResultsLock(results_dir):
                _, job_record_changed = _update_job_record_locked(results_dir, job_id)
                update = _regenerate_perf_csv_locked(results_dir)
            return JobCollection(existing, path, job_record_changed or update.changed, update.skipped, attempt)

    evidence, verdict = _decide_job(results_dir, job_id, attempt, dict(model or {}), nodes)
    record = _build_record(job_id, attempt, evidence, verdict.status, verdict.reason, verdict.per_node)
    if not write:
        return JobCollection(record, path, True, [], attempt)
    return _write_record_and_perf_csv(results_dir, record, overwrite=force)


def write_failure_record(
    results_dir: str,
    job_id: str,
    reason: str,
    slurm_state: Optional[str] = None,
    model: Optional[Mapping[str, Any]] = None,
    nodes: Sequence[str] = (),
    write: bool = True,
    attempt: Optional[int] = None,
) -> JobCollection:
    """Write a FAILURE record for an attempt that left none (the afterany job: cancelled, killed, never ran).

    ``attempt`` as in `collect_job`. Whatever the nodes left is kept as evidence; an existing record of the
    attempt is never overwritten (``changed`` False).
    """
    require_pandas()
    job_id = validate_job_id(job_id)
    attempt = _attempt_to_collect(results_dir, job_id, attempt)
    _check_job_dirs(results_dir, job_id, attempt, create=write)
    load_record(results_dir, job_id)  # a job record that cannot be read is refused and kept, never replaced
    path = record_path(results_dir, job_id, attempt)
    existing = load_record(results_dir, job_id, attempt)
    if existing is not None:
        return JobCollection(existing, path, False, [], attempt)

    evidence, verdict = _decide_job(results_dir, job_id, attempt, dict(model or {}), nodes)
    full_reason = reason.strip() or "the job left no record"
    if slurm_state:
        full_reason += " (SLURM state {0})".format(slurm_state)
    if verdict.status == FAILURE:
        full_reason += "; " + verdict.reason
    record = _build_record(job_id, attempt, evidence, FAILURE, full_reason, verdict.per_node, slurm_state)
    if not write:
        return JobCollection(record, path, True, [], attempt)
    return _write_record_and_perf_csv(results_dir, record, overwrite=False)
