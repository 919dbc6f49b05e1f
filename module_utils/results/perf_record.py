"""A job's records and the results dir's perf.csv (docs/contracts.md), all written under an exclusive ``flock`` on
``<results_dir>/perf.csv.lock`` so two jobs finishing together never lose each other's rows. Controller side only."""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import json
import os
import re
import stat
import time
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError

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
LOCK_TIMEOUT_SECONDS = 300.0


class PerfCsvUpdate(NamedTuple):
    """The regenerated perf.csv: its path, row count, whether it changed, and the record files left out."""

    path: str
    rows: int
    changed: bool
    skipped: List[Dict[str, str]]


_LOCK_FIX = (
    "a results dir shared by several users belongs to a group they are all in (chgrp TEAM DIR && "
    "chmod 3775 DIR) and its lock file is readable by them (chmod 0664 {0})"
)


class _ResultsLock:
    """Exclusive flock on ``<results_dir>/perf.csv.lock``, given up after a deadline with a clear error; opened
    read-only where we may not write (NFS emulates flock with POSIX locks, which need it), created 0664, never through
    a symlink."""

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

    def _error(self, exc: OSError, doing: str) -> JobLayoutError:
        if exc.errno == errno.ENOLCK:
            return JobLayoutError(
                f"cannot lock {self.path}: no locks available (ENOLCK). The results dir is on a filesystem mounted "
                "without lock support (NFSv3 'nolock', or no lockd/statd): remount it with locking (NFSv4, or NFSv3 "
                "with rpc.statd running), or choose a results_dir on storage with working locks (Lustre needs "
                "-o flock)"
            )
        if exc.errno == errno.ELOOP:
            return JobLayoutError(
                f"{self.path} is a symbolic link, which someone may have planted to redirect our writes: remove it "
                "and collect again"
            )
        if exc.errno == errno.EBADF:
            return JobLayoutError(
                f"cannot lock {self.path}: this filesystem (NFS) locks only files opened for writing, and the lock "
                f"file is not writable by you; {_LOCK_FIX.format(self.path)}"
            )
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return JobLayoutError(
                f"cannot {doing} {self.path}: {exc.strerror}. To collect into a results dir you must be able to read "
                f"its lock file and write the dir; {_LOCK_FIX.format(self.path)}"
            )
        return JobLayoutError(f"cannot {doing} {self.path}: {exc.strerror or exc}")

    def __enter__(self) -> _ResultsLock:
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
                raise JobLayoutError(
                    f"another process has held {self.path} for {self.timeout:.0f} s; if no collect is running, that "
                    "process is stuck: stop it, then collect again"
                )
            time.sleep(0.05)

    def __exit__(self, *exc_info: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _json_bytes(data: Any) -> bytes:
    # No indent: only the compact form uses json's C encoder, and a record can hold 100k rows.
    return (json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


def record_path(results_dir: str, job_id: str, attempt: Optional[int] = None) -> str:
    """Where the job's record lives (``attempt`` None), or one attempt's record (its completion marker)."""
    if attempt is None:
        return job_layout.job_record_path(results_dir, job_id)
    return job_layout.attempt_record_path(results_dir, job_id, attempt)


def load_record(results_dir: str, job_id: str, attempt: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The job's record (or, with ``attempt``, that attempt's), None when there is none; a malformed record raises:
    it is never replaced silently."""
    path = record_path(results_dir, job_id, attempt)
    try:
        record = safe_files.read_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if getattr(exc, "errno", None) == errno.ELOOP:
            raise JobLayoutError(
                f"the record {path} is a symbolic link, which someone may have planted to make us read or overwrite "
                "another file: remove it and collect again"
            ) from None
        raise JobLayoutError(
            f"the record {path} exists but cannot be read ({exc}); move it aside or collect again with force"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise JobLayoutError(
            f"the record {path} is not a slurm-multi record (no 'rows' list); move it aside or collect again with force"
        )
    return record


def _natural_job_key(path: str) -> Tuple[int, str]:
    name = os.path.basename(path)[: -len(".json")]
    digits = re.match(r"\d+", name)
    return (int(digits.group()) if digits else -1, name)


def _perf_csv_bytes(rows: Iterable[Mapping[str, Any]], extra_columns: Sequence[str] = ()) -> bytes:
    # The csv module, not pandas: writing rows needs no frame, and importing pandas costs a second per collect.
    columns = list(PERF_CSV_COLUMNS) + [name for name in extra_columns if name not in PERF_CSV_COLUMNS]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, restval="", extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if value is None or value != value else value for key, value in row.items()})
    return text.getvalue().encode("utf-8")


def _regenerate_perf_csv_locked(results_dir: str) -> PerfCsvUpdate:
    records_dir = job_layout.records_dir(results_dir)
    try:
        # Job records only: each attempt's record sits in records/<job_id>/, a directory.
        names = [
            name
            for name in os.listdir(records_dir)
            if name.endswith(".json") and not name.startswith(".") and os.path.isfile(os.path.join(records_dir, name))
        ]
    except FileNotFoundError:
        names = []
    rows = []  # type: List[Mapping[str, Any]]
    skipped = []  # type: List[Dict[str, str]]
    for path in sorted((os.path.join(records_dir, name) for name in names), key=_natural_job_key):
        try:
            record = safe_files.read_json_file(path)
        except (OSError, ValueError) as exc:
            skipped.append({"path": path, "reason": f"unreadable: {exc}"})
            continue
        record_rows = record.get("rows") if isinstance(record, dict) else None
        if not isinstance(record_rows, list) or not all(isinstance(row, dict) for row in record_rows):
            skipped.append({"path": path, "reason": "not a slurm-multi record: no 'rows' list of objects"})
            continue
        # A sweep's record repeats its models' rows, which their own records bring.
        if "sweep" not in record:
            rows.extend(record_rows)

    perf_csv = os.path.join(results_dir, job_layout.PERF_CSV)
    data = _perf_csv_bytes(rows)
    unchanged = _file_holds(perf_csv, data)
    if not unchanged:
        _write_perf_csv(results_dir, perf_csv, data)
    return PerfCsvUpdate(perf_csv, len(rows), not unchanged, skipped)


def _write_perf_csv(results_dir: str, path: str, data: bytes) -> None:
    """Replace perf.csv atomically; a teammate's perf.csv in a team's (sticky, group-writable) results dir is rewritten
    in place instead, under the results lock, since only a file's owner may replace it there."""
    shared = bool(os.stat(results_dir).st_mode & stat.S_IWGRP)
    try:
        safe_files.write_file_atomically(path, data, 0o664 if shared else 0o644)
        return
    except PermissionError:
        if not shared:
            raise
    fix = f"In a team's results dir perf.csv is the team's file: its owner makes it group-writable (chmod 0664 {path})"
    try:
        # O_NONBLOCK: a FIFO planted by a teammate fails here (ENXIO) instead of blocking the collect.
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise JobLayoutError(f"cannot rewrite {path}: {exc.strerror}. {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JobLayoutError(f"{path} is not a regular file: remove it (its owner may), and collect again")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


def regenerate_perf_csv(results_dir: str) -> PerfCsvUpdate:
    """Rebuild ``perf.csv`` from every job record when its content changes; unreadable records are listed in
    ``skipped`` and left untouched."""
    results_dir_trust.check_results_dir(results_dir, create=True)
    with _ResultsLock(results_dir):
        return _regenerate_perf_csv_locked(results_dir)


def _file_holds(path: str, data: bytes) -> bool:
    try:
        return safe_files.read_file(path) == data
    except OSError:
        return False


def _summary(results_dir: str, path: str, record: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        "attempt": record.get("attempt"),
        "status": record.get("status"),
        "reason": record.get("reason"),
        "slurm_state": record.get("slurm_state"),
        "collected_at": record.get("collected_at"),
        "record": os.path.relpath(path, results_dir),
    }


def _update_job_record_locked(results_dir: str, job_id: str) -> bool:
    """Rebuild the job's record from its attempts' records (the last attempt's, with ``attempts`` naming each),
    written CSV first, JSON last, only when its content changed; whether it did."""
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
        return False
    job_record = dict(last, attempts=summaries)
    path = record_path(results_dir, job_id)
    csv_data = _perf_csv_bytes(job_record["rows"], job_record.get("extra_columns") or [])
    json_data = _json_bytes(job_record)
    changed = False
    if not _file_holds(path[: -len(".json")] + ".csv", csv_data):
        safe_files.write_file_atomically(path[: -len(".json")] + ".csv", csv_data, 0o644)
        changed = True
    if not _file_holds(path, json_data):
        safe_files.write_file_atomically(path, json_data, 0o644)
        changed = True
    return changed


def refresh_job_record_and_perf_csv(results_dir: str, job_id: str) -> Tuple[bool, List[Dict[str, str]]]:
    """Bring the job's record and perf.csv up to date with the attempt records on disk, locked: ``(changed, the
    record files perf.csv left out)``."""
    with _ResultsLock(results_dir):
        job_record_changed = _update_job_record_locked(results_dir, job_id)
        update = _regenerate_perf_csv_locked(results_dir)
    return job_record_changed or update.changed, update.skipped


def write_attempt_record(
    results_dir: str, record: Dict[str, Any], overwrite: bool
) -> Tuple[Dict[str, Any], bool, List[Dict[str, str]]]:
    """Write the attempt's record unless it exists (or ``overwrite``), then the job's record and perf.csv, locked:
    ``(the attempt's record on disk, changed, the record files perf.csv left out)``."""
    job_id, attempt = record["job_id"], record["attempt"]
    path = record_path(results_dir, job_id, attempt)
    results_dir_trust.make_job_dirs(os.path.dirname(path), results_dir)
    with _ResultsLock(results_dir):
        existing = None if overwrite else load_record(results_dir, job_id, attempt)
        if existing is None:
            # The attempt's CSV first, its JSON last: the JSON is the attempt's completion marker.
            safe_files.write_file_atomically(
                path[: -len(".json")] + ".csv", _perf_csv_bytes(record["rows"], record["extra_columns"]), 0o644
            )
            safe_files.write_file_atomically(path, _json_bytes(record), 0o644)
        job_record_changed = _update_job_record_locked(results_dir, job_id)
        update = _regenerate_perf_csv_locked(results_dir)
    changed = existing is None or job_record_changed or update.changed
    return existing or record, changed, update.skipped
