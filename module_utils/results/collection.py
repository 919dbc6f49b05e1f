"""The postprocessing stage (controller side): what a job attempt's nodes left becomes one verdict (verdict.py) and
one record (perf_record.py). A results dir or job dir another user owns or could write is refused."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import PROVENANCE_KEYS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import read_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import (
    FAILURE,
    SKIPPED,
    SUCCESS,
    validate_job_id,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_csv import (
    load_best_results_csv,
    pandas,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import (
    PERF_CSV_COLUMNS,
    load_record,
    record_path,
    refresh_job_record_and_perf_csv,
    write_attempt_record,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.timeline import (
    barrier_waits,
    cross_node_summary,
    job_timeline,
    stragglers,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import (
    Verdict,
    decide_verdict,
    has_metric,
    load_node_status,
    missing_metric_reason,
    nodes_in_rank_order,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import STACKS_JSON, hang_finding
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import scan_log_file

if TYPE_CHECKING:
    import pandas as pd

DEPLOYMENT_TYPE = "slurm"
LAUNCHER = "slurm_multi"

BUILD_MANIFEST_FILE = "build_manifest.json"
# The record's column after MAD's that names the runtime the job ran under (docker, charliecloud; "" unknown).
RUNTIME_COLUMN = "container_runtime"
# Card keys whose perf.csv column has another name.
_CARD_TO_PERF_COLUMN = {"name": "model", "dockerfile": "docker_file"}


class JobCollection(NamedTuple):
    """What collecting a job produced: the record, where it lives, and whether anything on disk changed."""

    record: Dict[str, Any]
    record_path: str
    changed: bool
    perf_csv_skipped: List[Dict[str, str]]
    attempt: int = 0


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _json_object(path: str) -> Optional[Dict[str, Any]]:
    """A JSON file's object; None when it is missing, unreadable or no object."""
    try:
        content = safe_files.read_json_file(path)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _model_name(model: Mapping[str, Any], run_context: Mapping[str, Any]) -> str:
    if model.get("name"):
        return str(model["name"])
    from_context = run_context.get("model")
    if isinstance(from_context, dict):
        return str(from_context.get("name") or "")
    return str(from_context or "")


class _ImageRan(NamedTuple):
    """What ran the job: the container runtime and the image's identity (``""`` where unknown), and why the nodes'
    statuses disagree on them (warnings: the verdict does not rest on them)."""

    container_runtime: str
    image_id: str
    warnings: List[str]


def _image_ran(nodes: Sequence[str], statuses: Mapping[str, Any], configured_runtime: str = "") -> _ImageRan:
    """Rank 0's runtime and image ID from its status.json (else the first node's in rank order that names them),
    each other node's checked against it. With no status naming a runtime (the job ended before its run stage) the
    job's own setting stands, else ``""``."""
    found = {}  # type: Dict[str, Tuple[str, str]]
    warnings = []  # type: List[str]
    for field in ("container_runtime", "image_id"):
        named = [
            (rank, node, str(statuses[node][field]))
            for rank, node in enumerate(nodes)
            if isinstance(statuses.get(node), dict) and statuses[node].get(field)
        ]
        if not named:
            continue
        first_rank, first_node, value = named[0]
        found[field] = (first_node, value)
        others = [f"{node} (rank {rank}) {other}" for rank, node, other in named[1:] if other != value]
        if others:
            warnings.append(
                f"the nodes name different {field}s: {first_node} (rank {first_rank}) {value}, "
                + ", ".join(others)
                + f"; the record names {first_node}'s"
            )
    runtime = found["container_runtime"][1] if "container_runtime" in found else str(configured_runtime or "")
    return _ImageRan(runtime, found["image_id"][1] if "image_id" in found else "", warnings)


def _common_row(
    model: Mapping[str, Any],
    model_name: str,
    nodes: Sequence[str],
    statuses: Mapping[str, Any],
    image_ran: Optional[_ImageRan] = None,
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
    # MAD's n_gpus is the run's total; a card's n_gpus is per node. "-1" (all allocated) is what each node's run
    # reported giving its container, when every node did; else it stays as the card says.
    given = [s.get("n_gpus") for s in statuses.values() if isinstance(s, dict) and _is_number(s.get("n_gpus"))]
    if gpus_per_node.isdigit() and int(gpus_per_node) > 0:
        row["n_gpus"] = str(int(gpus_per_node) * max(len(nodes), 1))
    elif given and len(given) == len(nodes):
        row["gpus_per_node"] = str(given[0]) if len(set(given)) == 1 else ""
        row["n_gpus"] = str(sum(given))
    else:
        row["n_gpus"] = gpus_per_node
    if not row["machine_name"] and nodes:
        row["machine_name"] = nodes[0]
    row["deployment_type"] = DEPLOYMENT_TYPE
    # What the nodes' runs said (rank 0's first): the launcher, and where the card says nothing the image's
    # provenance (the build manifest's) and the GPUs' architecture.
    ran = [s for s in statuses.values() if isinstance(s, dict) and s.get("launcher")]
    row["launcher"] = str(ran[0]["launcher"]) if ran else LAUNCHER
    if ran:
        provenance = ran[0].get("provenance") if isinstance(ran[0].get("provenance"), dict) else {}
        for column in PROVENANCE_KEYS:
            row[column] = row[column] or _text(provenance.get(column))
        row["gpu_architecture"] = row["gpu_architecture"] or _text(ran[0].get("gpu_architecture"))
    if image_ran is not None and image_ran.container_runtime == "charliecloud" and image_ran.image_id:
        # MAD's perf.csv has no column for the runtime, and a Charliecloud base has no digest (its identity is a
        # file's path, size and time): docker_sha holds the image's own, the squashfs file's sha256:<hex>.
        row["docker_sha"] = image_ran.image_id
    started = [s["started_at"] for s in statuses.values() if isinstance(s, dict) and _is_number(s.get("started_at"))]
    ended = [s["ended_at"] for s in statuses.values() if isinstance(s, dict) and _is_number(s.get("ended_at"))]
    if started and ended and max(ended) >= min(started):
        row["test_duration"] = f"{max(ended) - min(started):.2f}"
    return row


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _node_dirs(job_dir: str) -> List[str]:
    try:
        return sorted(name for name in os.listdir(job_layout.nodes_dir(job_dir)) if not name.startswith("."))
    except OSError:
        return []


def _results_csv_candidates(node_dir: str, multiple_results: str) -> List[str]:
    """The node's results CSVs: the card's multiple_results and each local rank's (job_layout.is_results_file),
    else, when the card names none, every CSV in the node dir."""
    try:
        names = sorted(os.listdir(node_dir))
    except OSError:
        return []
    return [
        os.path.join(node_dir, name)
        for name in names
        if (job_layout.is_results_file(name, multiple_results) if multiple_results else name.endswith(".csv"))
        and os.path.isfile(os.path.join(node_dir, name))
    ]


def _rows_from_results_csv(frame: pd.DataFrame, common: Mapping[str, str], model_name: str) -> List[Dict]:
    table = pandas().DataFrame(dict(common), index=frame.index, columns=list(PERF_CSV_COLUMNS))
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
    # Each node's last figure per metric in its log: {node: {metric: value}}, for the cross-node summary.
    node_figures: Dict[str, Dict[str, float]]
    # When a node says the run hung: the finding on every node's stacks (module_utils/run/hang/finding.py), else None.
    hang: Optional[Dict[str, Any]] = None
    image_ran: _ImageRan = _ImageRan("", "", [])


def _gather_job(
    results_dir: str,
    job_id: str,
    attempt: int,
    model: Mapping[str, Any],
    nodes: Sequence[str],
    container_runtime: str = "",
) -> _JobEvidence:
    """Everything the attempt's nodes left, and the perf rows: the best results CSV's, else the last log line."""
    attempt_dir = job_layout.attempt_dir(results_dir, job_id, attempt)
    run_context = _json_object(os.path.join(attempt_dir, job_layout.RUN_CONTEXT_FILE)) or {}
    hosts = run_context.get("hosts")
    if not nodes and isinstance(hosts, list) and all(isinstance(host, str) for host in hosts):
        nodes = hosts
    node_dirs = {
        node: job_layout.node_dir(results_dir, job_id, attempt, node) for node in list(nodes) or _node_dirs(attempt_dir)
    }
    statuses = {
        node: load_node_status(os.path.join(node_dir, job_layout.STATUS_FILE)) for node, node_dir in node_dirs.items()
    }
    nodes = list(nodes) or nodes_in_rank_order(statuses)
    model_name = _model_name(model, run_context)
    image_ran = _image_ran(nodes, statuses, container_runtime)
    common = _common_row(model, model_name, nodes, statuses, image_ran)

    candidates = []  # type: List[str]
    log_findings = {}  # type: Dict[str, Dict[str, Any]]
    node_figures = {}  # type: Dict[str, Dict[str, float]]
    last_report = None
    for node in nodes:
        node_dir = node_dirs[node]
        candidates.extend(_results_csv_candidates(node_dir, _text(model.get("multiple_results"))))
        try:
            scan = scan_log_file(os.path.join(node_dir, job_layout.RUN_LOG))
        except OSError:
            continue
        log_findings[node] = {"perf_lines": len(scan.perf_lines), "error_pattern": scan.error_pattern}
        figures = {perf.metric: perf.value for perf in scan.perf_lines if perf.value is not None}
        if figures:
            node_figures[node] = figures  # the last figure per metric
        if scan.perf_lines:
            # The last rank that reports is the conventional reporter; its last line is the final figure (a line
            # whose number is none, a script's `-1` on failure, makes a row that says why).
            last_report = (node, scan.perf_lines[-1])

    frame, best_csv, csv_report = load_best_results_csv(candidates, without_figures=last_report is None)
    if frame is not None:
        rows = _rows_from_results_csv(frame, common, model_name)
        extra_columns = [name for name in frame.columns if name not in PERF_CSV_COLUMNS]
        metric_source = os.path.relpath(best_csv, results_dir)
    elif last_report is not None:
        node, perf = last_report
        rows = [dict(common, performance=perf.raw.replace(",", ""), metric=perf.metric)]
        extra_columns = []
        metric_source = os.path.relpath(os.path.join(node_dirs[node], job_layout.RUN_LOG), results_dir)
    else:
        rows, extra_columns, metric_source = [dict(common)], [], ""
    # The runtime beside MAD's columns: in the record and its CSV, never in perf.csv (MAD's 29 columns).
    for row in rows:
        row[RUNTIME_COLUMN] = image_ran.container_runtime
    extra_columns = [name for name in extra_columns if name != RUNTIME_COLUMN] + [RUNTIME_COLUMN]
    return _JobEvidence(
        nodes,
        statuses,
        read_abort_marker(attempt_dir),
        rows,
        extra_columns,
        metric_source,
        csv_report,
        log_findings,
        node_figures,
        _hang(nodes, node_dirs, statuses),
        image_ran,
    )


def _hang(
    nodes: Sequence[str], node_dirs: Mapping[str, str], statuses: Mapping[str, Optional[Mapping[str, Any]]]
) -> Optional[Dict[str, Any]]:
    """The finding on the nodes' stacks when any node's status says the run hung; None otherwise."""
    if not any(isinstance(status, Mapping) and status.get("hang") for status in statuses.values()):
        return None
    stacks = {node: _json_object(os.path.join(node_dirs[node], STACKS_JSON)) for node in nodes}
    return hang_finding(stacks, node_ranks={node: rank for rank, node in enumerate(nodes)})


def _card_of_attempt(attempt_dir: str) -> Dict[str, Any]:
    """The model card of the attempt's own build manifest, or {} when it names no single model: what collect run
    apart from the nodes' play (pull mode, the afterany collect job) knows of the model."""
    manifest = _json_object(os.path.join(attempt_dir, BUILD_MANIFEST_FILE)) or {}
    models = manifest.get("built_models")
    if isinstance(models, dict) and len(models) == 1:
        (card,) = models.values()
        return dict(card) if isinstance(card, dict) else {}
    return {}


def _decide_job(
    results_dir: str,
    job_id: str,
    attempt: int,
    model: Mapping[str, Any],
    nodes: Sequence[str],
    container_runtime: str = "",
) -> Tuple[_JobEvidence, Verdict]:
    if not model:
        model = _card_of_attempt(job_layout.attempt_dir(results_dir, job_id, attempt))
    evidence = _gather_job(results_dir, job_id, attempt, model, nodes, container_runtime)
    metric_rows = [row for row in evidence.rows if has_metric(row)]
    return evidence, decide_verdict(
        evidence.statuses, metric_rows, evidence.nodes, evidence.abort_marker, evidence.hang
    )


def _build_record(
    results_dir: str,
    job_id: str,
    attempt: int,
    evidence: _JobEvidence,
    status: str,
    reason: str,
    per_node: Dict[str, Dict[str, Any]],
    slurm_state: Optional[str] = None,
) -> Dict[str, Any]:
    for row in evidence.rows:
        row["status"] = SKIPPED if status == SKIPPED else SUCCESS if status == SUCCESS and has_metric(row) else FAILURE
        if status != SKIPPED and not has_metric(row):
            # The record says why a row failed (perf.csv has no column for it): "N/A" is no figure.
            row["failure_reason"] = missing_metric_reason(row)
    for node, findings in evidence.log_findings.items():
        if node in per_node:
            per_node[node]["log"] = findings
    timeline = job_timeline({node: evidence.statuses.get(node) for node in evidence.nodes})
    record = {
        "job_id": job_id,
        "attempt": attempt,
        "status": status,
        "reason": reason,
        "slurm_state": slurm_state,
        "nodes": evidence.nodes,
        # What ran it: the runtime and the image's identity, rank 0's (docs/results.md), "" where unknown.
        "container_runtime": evidence.image_ran.container_runtime,
        "image_id": evidence.image_ran.image_id,
        "warnings": list(evidence.image_ran.warnings),
        "per_node": per_node,
        "metric_source": evidence.metric_source,
        "abort_marker": evidence.abort_marker,
        "results_csv_candidates": evidence.csv_report,
        "extra_columns": evidence.extra_columns,
        "rows": evidence.rows,
        # When each node did each step, each node's wait at the barrier, and each step's slowest node
        # (module_utils/results/timeline.py).
        "timeline": timeline,
        "barrier_wait": barrier_waits(timeline),
        "stragglers": stragglers(timeline),
        # Where several ranks report a figure: per metric, each node's last one, their mean, std, cv, count and
        # outlier nodes.
        "perf_summary": cross_node_summary(evidence.node_figures),
        # Who a hung run waited for, from every node's stacks (null unless a node says the run hung).
        "hang": evidence.hang,
        "collected_at": time.time(),
    }
    _add_preflight(record, results_dir, evidence)
    return record


def _add_preflight(record: Dict[str, Any], results_dir: str, evidence: _JobEvidence) -> None:
    """The preflight stage's per-node problems (module_utils/node/preflight.py), when the stage ran."""
    attempt_dir = job_layout.attempt_dir(results_dir, record["job_id"], record["attempt"])
    section = preflight.record_section(attempt_dir, evidence.nodes, evidence.statuses)
    if section is None:
        return
    record["preflight"] = section
    # A node whose own status could not say it (its results dir not shared: pull mode hears of it only by its
    # missing result) is named with its problem in the reason too.
    unsaid = [
        f"{node}: {preflight.summary(problems)}"
        for node, problems in section.items()
        if problems and preflight.summary(problems) not in record["reason"]
    ]
    if unsaid and record["status"] == FAILURE:
        record["reason"] = "preflight: " + "; ".join(unsaid) + "; " + record["reason"]


def _check_job_dirs(results_dir: str, job_id: str, attempt: int, create: bool) -> None:
    """Refuse a results dir, job dir or attempt dir that another user owns or could write (job_layout)."""
    if not results_dir_trust.check_results_dir(results_dir, create=create):
        return
    for path, what in (
        (job_layout.job_dir(results_dir, job_id), "job directory"),
        (job_layout.attempt_dir(results_dir, job_id, attempt), "attempt directory"),
    ):
        if os.path.lexists(path):
            results_dir_trust.check_directory(path, what)


def _attempt_to_decide(results_dir: str, job_id: str, attempt: Optional[int], write: bool) -> Tuple[str, int, str]:
    """The job ID and attempt checked (None: the job's last attempt on disk), and the attempt's record path."""
    job_id = validate_job_id(job_id)
    if attempt is None:
        attempt = job_layout.latest_attempt(results_dir, job_id)
    attempt = job_layout.validate_attempt(attempt)
    _check_job_dirs(results_dir, job_id, attempt, create=write)
    load_record(results_dir, job_id)  # a job record that cannot be read is refused and kept, never replaced
    return job_id, attempt, record_path(results_dir, job_id, attempt)


def collect_job(
    results_dir: str,
    job_id: str,
    model: Optional[Mapping[str, Any]] = None,
    nodes: Sequence[str] = (),
    force: bool = False,
    write: bool = True,
    attempt: Optional[int] = None,
    container_runtime: str = "",
) -> JobCollection:
    """Decide an attempt's verdict from what its nodes left and write its record (the collect_results module's options).
    ``write=False`` decides without touching anything; an attempt with a record is decided again only with ``force``.
    ``container_runtime``: the job's setting, which the record names when no node's status does."""
    job_id, attempt, path = _attempt_to_decide(results_dir, job_id, attempt, write)
    if not force:
        existing = load_record(results_dir, job_id, attempt)
        if existing is not None:
            if not write:
                return JobCollection(existing, path, False, [], attempt)
            changed, skipped = refresh_job_record_and_perf_csv(results_dir, job_id)
            return JobCollection(existing, path, changed, skipped, attempt)

    evidence, verdict = _decide_job(results_dir, job_id, attempt, dict(model or {}), nodes, container_runtime)
    record = _build_record(results_dir, job_id, attempt, evidence, verdict.status, verdict.reason, verdict.per_node)
    return _write(results_dir, record, path, write, overwrite=force)


def write_failure_record(
    results_dir: str,
    job_id: str,
    reason: str,
    slurm_state: Optional[str] = None,
    model: Optional[Mapping[str, Any]] = None,
    nodes: Sequence[str] = (),
    write: bool = True,
    attempt: Optional[int] = None,
    container_runtime: str = "",
) -> JobCollection:
    """Write a FAILURE record for an attempt that left none (the afterany job: cancelled, killed, never ran), with
    whatever the nodes left as evidence; an existing record of the attempt is never overwritten.
    ``container_runtime``: the job's setting, which the record names when no node's status does."""
    job_id, attempt, path = _attempt_to_decide(results_dir, job_id, attempt, write)
    existing = load_record(results_dir, job_id, attempt)
    if existing is not None:
        return JobCollection(existing, path, False, [], attempt)

    evidence, verdict = _decide_job(results_dir, job_id, attempt, dict(model or {}), nodes, container_runtime)
    full_reason = reason.strip() or "the job left no record"
    if slurm_state:
        full_reason += f" (SLURM state {slurm_state})"
    if verdict.status == FAILURE:
        full_reason += "; " + verdict.reason
    record = _build_record(results_dir, job_id, attempt, evidence, FAILURE, full_reason, verdict.per_node, slurm_state)
    return _write(results_dir, record, path, write, overwrite=False)


def _write(results_dir: str, record: Dict[str, Any], path: str, write: bool, overwrite: bool) -> JobCollection:
    if not write:
        return JobCollection(record, path, True, [], record["attempt"])
    written, changed, skipped = write_attempt_record(results_dir, record, overwrite)
    return JobCollection(written, path, changed, skipped, record["attempt"])
