"""A job's files in the shared results directory (docs/contracts.md): every path, the attempt rule, and the node's
status.json. SLURM keeps the job ID on requeue, so each attempt writes under ``attempt-<N>``. Standard library only."""

from __future__ import annotations

import os
import re
import secrets
import time
from typing import Any, List, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_json_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import is_slurm_job_id
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

ATTEMPT_ENV = "SLURM_RESTART_COUNT"
ABORT_MARKER = "ABORT"
STATUS_FILE = "status.json"
RUN_LOG = "run.log"
DIAGNOSTICS_FILE = "diagnostics.txt"
NODES_DIR = "nodes"
RECORDS_DIR = "records"
PERF_CSV = "perf.csv"
LOCK_FILE = "perf.csv.lock"
RUN_CONTEXT_FILE = "run_context.json"

# The one job-ID rule, for every ID a stage meets: SLURM's (4242; an array task 4242_7; a heterogeneous job's
# component 4242+1), a local run's (local-<time>-<hex>, `local_run_id`) and one a user gives (4242.2, a second run
# in the same allocation). The ID names files, directories and containers and travels in argv: it starts with a
# letter or digit (never '-', an option; never '.', a hidden or parent dir).
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
LOCAL_RUN_PREFIX = "local-"
_ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")
_NODE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class JobLayoutError(UserError):
    """A job ID, attempt, node name or results directory that cannot be used, with what to do instead."""


# ---------------------------------------------------------------------------------------------------------- names


def is_job_id(job_id: Any) -> bool:
    """True when ``job_id`` follows the job-ID rule (see `validate_job_id`)."""
    return isinstance(job_id, (str, int)) and not isinstance(job_id, bool) and bool(_JOB_ID.match(str(job_id)))


def validate_job_id(job_id: Any) -> str:
    """The job ID as a string, refused unless it follows the one job-ID rule (it names files, dirs, containers)."""
    job_id = str(job_id).strip()
    if not is_job_id(job_id):
        raise JobLayoutError(
            f"job_id {job_id!r} is not a SLURM job ID or a local run's: start with a letter or digit, then letters, "
            "digits, '_', '+', '-' and '.' only (e.g. 4242, 4242_7, 4242+1 or local-20261130120000-ab12)"
        )
    return job_id


def local_run_id(now: Optional[float] = None, suffix: Optional[str] = None) -> str:
    """A run's ID outside SLURM: ``local-<YYYYmmddHHMMSS>-<4 hex>``; the suffix keeps two runs in one second apart."""
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(now))
    return f"{LOCAL_RUN_PREFIX}{stamp}-{secrets.token_hex(2) if suffix is None else suffix}"


def job_id_for_run(job_id: Optional[str]) -> str:
    """The run's job ID: the one given (SLURM_JOB_ID, or the user's), else a new `local_run_id`."""
    return validate_job_id(job_id) if job_id is not None and str(job_id).strip() else local_run_id()


def is_slurm_job_number(job_id: Any) -> bool:
    """True for SLURM's own number of a job (SLURM_JOB_ID, squeue's %A): digits only. An array task or a
    heterogeneous component has one too, so this is what squeue is asked about and answers under."""
    return is_slurm_job_id(job_id) and job_id.isdigit()


def validate_attempt(attempt: Any) -> int:
    """The attempt number as an int (0 for the first run, n after the n-th requeue)."""
    text = str(attempt).strip()
    if isinstance(attempt, bool) or not text.isdigit():
        raise JobLayoutError(
            f"attempt {attempt!r} is not an attempt number: use 0 for a job's first run, n after its n-th requeue "
            "(SLURM_RESTART_COUNT)"
        )
    return int(text)


def attempt_from_env(environ: Mapping[str, str]) -> int:
    """This run's attempt: ``SLURM_RESTART_COUNT`` (SLURM sets it in a requeued job), 0 when unset."""
    value = environ.get(ATTEMPT_ENV, "").strip()
    return validate_attempt(value) if value else 0


def _validate_node(node: str) -> str:
    if not _NODE.match(str(node)):
        raise JobLayoutError(
            f"node name {node!r} cannot name a results directory: letters, digits, '_', '.' and '-' only"
        )
    return str(node)


# ---------------------------------------------------------------------------------------------------------- paths


def job_dir(results_dir: str, job_id: str) -> str:
    """``<results_dir>/<job_id>``: every attempt of the job."""
    return os.path.join(results_dir, validate_job_id(job_id))


def attempt_dir(results_dir: str, job_id: str, attempt: int) -> str:
    """``<results_dir>/<job_id>/attempt-<N>``: one attempt's ABORT marker, manifest and node dirs."""
    return os.path.join(job_dir(results_dir, job_id), f"attempt-{validate_attempt(attempt)}")


def nodes_dir(attempt_path: str) -> str:
    """``<attempt dir>/nodes``: one directory per node of the attempt."""
    return os.path.join(attempt_path, NODES_DIR)


def node_dir(results_dir: str, job_id: str, attempt: int, node: str) -> str:
    """``<results_dir>/<job_id>/attempt-<N>/nodes/<node>``: the node's log, status, CSVs and diagnostics."""
    return os.path.join(nodes_dir(attempt_dir(results_dir, job_id, attempt)), _validate_node(node))


def node_workspace(node_path: str, job_id: str, attempt: int, node: str, shared_workspace: Optional[str] = None) -> str:
    """A node's own copy of the model's scripts, its container's working dir (one node's writes must not be
    another's): ``<node dir>/workspace`` (``node_path``: the node's dir), or under madengine's
    ``slurm.shared_workspace``, ``<shared_workspace>/<job_id>/attempt-<N>/<node>``."""
    if not shared_workspace:
        return os.path.join(node_path, "workspace")
    if not os.path.isabs(shared_workspace):
        raise JobLayoutError(f"slurm.shared_workspace {shared_workspace!r} must be an absolute path")
    attempt_name = f"attempt-{validate_attempt(attempt)}"
    return os.path.join(shared_workspace, validate_job_id(job_id), attempt_name, _validate_node(node))


def status_path(results_dir: str, job_id: str, attempt: int, node: str) -> str:
    """``.../nodes/<node>/status.json``: the node's status (`STATUS_FIELDS`)."""
    return os.path.join(node_dir(results_dir, job_id, attempt, node), STATUS_FILE)


def abort_marker_path(attempt_path: str) -> str:
    """The attempt's ABORT marker, in its attempt dir."""
    return os.path.join(attempt_path, ABORT_MARKER)


def records_dir(results_dir: str) -> str:
    """``<results_dir>/records``: every job's record."""
    return os.path.join(results_dir, RECORDS_DIR)


def job_record_path(results_dir: str, job_id: str) -> str:
    """``records/<job_id>.json``: the job's record (its last attempt's, naming every attempt)."""
    return os.path.join(records_dir(results_dir), validate_job_id(job_id) + ".json")


def attempt_record_path(results_dir: str, job_id: str, attempt: int) -> str:
    """``records/<job_id>/attempt-<N>.json``: the attempt's record, its completion marker."""
    return os.path.join(records_dir(results_dir), validate_job_id(job_id), f"attempt-{validate_attempt(attempt)}.json")


def attempts_run(results_dir: str, job_id: str) -> List[int]:
    """The attempts that left a directory, in order."""
    try:
        names = os.listdir(job_dir(results_dir, job_id))
    except OSError:
        return []
    return sorted(int(match.group(1)) for match in map(_ATTEMPT_DIR.match, names) if match)


def attempts_recorded(results_dir: str, job_id: str) -> List[int]:
    """The attempts that have a record, in order."""
    try:
        names = os.listdir(os.path.join(records_dir(results_dir), validate_job_id(job_id)))
    except OSError:
        return []
    numbers = (re.match(r"^attempt-(\d+)\.json$", name) for name in names)
    return sorted(int(match.group(1)) for match in numbers if match)


def latest_attempt(results_dir: str, job_id: str) -> int:
    """The job's last attempt that left anything (a directory or a record); 0 when none did."""
    return max(attempts_run(results_dir, job_id) + attempts_recorded(results_dir, job_id) + [0])


# ---------------------------------------------------------------------------------------------------- status.json

SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
# The model card's skip_gpu_arch names this node's GPUs: the model did not run here, and that is no failure.
SKIPPED = "SKIPPED"

# A node's status.json: the identity and every other field with its default, which the run module writes, and the
# fields only a failed stage's rescue writes. docs/contracts.md documents exactly these fields (what each holds;
# tests/unit/module_utils/job/test_job_layout.py checks it).
_STATUS_DEFAULTS = {
    "status": SUCCESS,
    "exit_code": None,
    "error_pattern": None,
    "aborted_by_rank": None,
    "cancelled": False,
    "timed_out": False,
    "perf_lines": 0,
    "n_gpus": None,
    "image_id": None,
    "container_runtime": None,
    "launcher": None,
    "hostname": None,
    "gpu_architecture": "",
    "provenance": {},
    "reason": "",
    "started_at": None,
    "ended_at": None,
    "steps": {},
    "hang": False,
    "tools": [],
    "tool_outputs": [],
}
RESCUE_STATUS_FIELDS = ("stage", "stopped_by_other_node", "preflight")
STATUS_FIELDS = ("node", "rank", "nnodes", "job_id", "model") + tuple(_STATUS_DEFAULTS) + RESCUE_STATUS_FIELDS


def _check_status_fields(status: Mapping[str, Any]) -> None:
    unknown = sorted(set(status) - set(STATUS_FIELDS))
    if unknown:
        raise JobLayoutError(
            "status.json has no field {}: add it to job_layout.STATUS_FIELDS and docs/contracts.md first".format(
                ", ".join(unknown)
            )
        )


def is_results_file(name: str, multiple_results: str) -> bool:
    """Whether file ``name`` is the card's multiple_results CSV (its base name) or a local rank's beside it,
    ``<stem>_rank<N><suffix>`` (a node running several ranks writes one each: perf.csv, perf_rank3.csv)."""
    wanted = os.path.basename(multiple_results or "")
    if not wanted:
        return False
    stem, suffix = os.path.splitext(wanted)
    return name == wanted or re.fullmatch(re.escape(stem) + r"_rank[0-9]+" + re.escape(suffix), name) is not None


def new_status(node: str, rank: Any, nnodes: Any, job_id: Any, model: str, **fields: Any) -> dict:
    """A node's status.json content: the identity given, every other field at its default unless in ``fields``."""
    status = {"node": node, "rank": rank, "nnodes": nnodes, "job_id": str(job_id), "model": model}
    status.update(_STATUS_DEFAULTS)
    status.update(fields)
    _check_status_fields(status)
    return status


def stage_failure_status(
    node: str,
    rank: Any,
    nnodes: Any,
    job_id: Any,
    model: str,
    stage: str,
    error: Optional[str] = None,
    aborted_by_rank: Any = None,
    steps: Optional[Mapping[str, Any]] = None,
    preflight: Optional[List[Any]] = None,
) -> dict:
    """The status.json a failed stage's rescue writes for a node whose run wrote none: ``error`` is what failed here,
    None when it was only stopped because another failed; the other arguments are the `STATUS_FIELDS` of their names."""
    if error is None:
        reason = f"stopped during the {stage} stage because another node failed"
    else:
        reason = f"the {stage} stage failed on {node}: {error}"
    return new_status(
        node,
        rank,
        nnodes,
        job_id,
        model,
        status=FAILURE,
        stage=stage,
        reason=reason,
        aborted_by_rank=aborted_by_rank,
        stopped_by_other_node=error is None,
        steps=dict(steps or {}),
        preflight=list(preflight or []),
    )


def write_status(path: str, status: Mapping[str, Any]) -> None:
    """Write a node's status.json atomically, refusing a field the schema does not know."""
    _check_status_fields(status)
    write_json_atomically(path, status)
