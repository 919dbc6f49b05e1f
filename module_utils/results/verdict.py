"""A job attempt's verdict from its nodes' ``status.json`` and its ABORT marker: the root-cause nodes first, then the
collateral ones, so a 64-node failure reads as one cause. Controller side, standard library only."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SKIPPED, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import (
    figure_problem,
    performance_figure,
)

NO_METRIC_REASON = "no performance metric found in any node's log or CSV"
# A node that left no status.json: its run stage never ran, or the node was lost (unreachable, dead).
NO_STATUS_REASON = "no status.json: its run stage never ran or the node was lost"
# A node_statuses value carrying this key stands for a status.json that exists but cannot be read.
STATUS_FILE_ERROR = "status_file_error"
# Node names listed in a reason before "and N more": a 64-node cancel stays one readable line.
REASON_NODES_SHOWN = 8


class Verdict(NamedTuple):
    """A job's verdict: SUCCESS or FAILURE, why, and each node's own verdict keyed by node name."""

    status: str
    reason: str
    per_node: Dict[str, Dict[str, Any]]


def _node_failure_cause(status: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why this node failed, or None when its status shows a clean run."""
    if status is None:
        return NO_STATUS_REASON
    if status.get(STATUS_FILE_ERROR):
        return f"status.json unreadable: {status[STATUS_FILE_ERROR]}"
    if status.get("status") == SKIPPED:
        return None  # the card's skip_gpu_arch matched: not run, and no failure
    if status.get("aborted_by_rank") is not None:
        return f"stopped because rank {status['aborted_by_rank']} failed"
    if status.get("hang"):
        # Its container was stopped for the hang: its exit code is the stop's, not the model's.
        return status.get("reason") or "hang"
    causes = []
    if status.get("cancelled"):
        causes.append("cancelled (SIGTERM: scancel, time limit or controller gone)")
    if status.get("timed_out"):
        causes.append("timed out (model timeout or end of the job's time limit)")
    exit_code = status.get("exit_code")
    if exit_code not in (None, 0):
        causes.append(f"container exited with code {exit_code}")
    if status.get("error_pattern"):
        causes.append(f"log matched error pattern {status['error_pattern']!r}")
    if causes:
        return ", ".join(causes)
    if status.get("status") == FAILURE:
        return f"node reported FAILURE: {status.get('reason') or 'no reason given'}"
    if exit_code is None:
        return "the container never ran (no exit code)"
    if status.get("status") != SUCCESS:
        return f"status.json has an unknown status {status.get('status')!r}"
    return None


def _describe_groups(groups: Dict[str, List[str]]) -> List[str]:
    parts = []
    for cause, labels in groups.items():
        shown = ", ".join(labels[:REASON_NODES_SHOWN])
        if len(labels) > REASON_NODES_SHOWN:
            shown += f" and {len(labels) - REASON_NODES_SHOWN} more"
        parts.append(f"{shown}: {cause}")
    return parts


def has_metric(row: Mapping[str, Any]) -> bool:
    """True when a perf row holds a performance figure (perf_lines.figure_problem: a plain positive finite decimal;
    an empty cell, ``-1``, ``0``, ``nan``, ``N/A`` or ``FAILED`` is no result, however a model spells its failure)."""
    return performance_figure(row.get("performance")) is not None


def missing_metric_reason(row: Mapping[str, Any]) -> str:
    """Why a perf row without a figure is a FAILURE row: which value its performance cell holds, and why that is no
    figure."""
    value = str(row.get("performance") if row.get("performance") is not None else "").strip()
    return f"performance {value!r} is no figure: {figure_problem(value)}" if value else "no performance figure"


def _as_rank(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def nodes_in_rank_order(statuses: Mapping[str, Optional[Mapping[str, Any]]]) -> List[str]:
    """The nodes that left a status, by the rank their status.json names (then by name)."""
    return sorted(statuses, key=lambda node: (_as_rank((statuses[node] or {}).get("rank")) or 0, node))


def decide_verdict(
    node_statuses: Mapping[str, Optional[Mapping[str, Any]]],
    perf_rows: Sequence[Mapping[str, Any]],
    expected_nodes: Sequence[str],
    abort_marker: Optional[Mapping[str, Any]] = None,
    hang: Optional[Mapping[str, Any]] = None,
) -> Verdict:
    """A job's verdict from its nodes' statuses and the perf rows found anywhere (docs/results.md); ``expected_nodes``:
    the allocation's nodes in rank order (empty: the nodes that left a status)."""
    nodes = list(expected_nodes) or nodes_in_rank_order(node_statuses)
    per_node = {}  # type: Dict[str, Dict[str, Any]]
    for index, node in enumerate(nodes):
        status = node_statuses.get(node)
        readable = status if status and not status.get(STATUS_FILE_ERROR) else {}
        cause = _node_failure_cause(status)
        aborted_by = _as_rank(readable.get("aborted_by_rank"))
        per_node[node] = {
            "rank": index if expected_nodes else _as_rank(readable.get("rank")),
            "status": FAILURE if cause else (SKIPPED if readable.get("status") == SKIPPED else SUCCESS),
            "reason": cause or "",
            # A node the pipeline stopped because another node's stage failed (the play's rescue) is collateral.
            "root_cause": bool(cause) and aborted_by is None and not readable.get("stopped_by_other_node"),
            "aborted_by_rank": aborted_by,
            "perf_lines": readable.get("perf_lines", 0),
            "node_reason": readable.get("reason", ""),
            # What a retry decides on (module_utils/results/retry_cause.py): the stage a rescue failed the node in, and
            # whether the model itself ran (its container's exit code), failed (error pattern) or was stopped.
            "stage": readable.get("stage"),
            "exit_code": readable.get("exit_code"),
            "error_pattern": readable.get("error_pattern"),
            "cancelled": bool(readable.get("cancelled")),
            "timed_out": bool(readable.get("timed_out")),
            "image_id": readable.get("image_id"),
            "hostname": readable.get("hostname"),
            "hang": bool(readable.get("hang")),
            # MAD's tools applied on the node, and their outputs (paths relative to the node dir, under tools/).
            "tools": readable.get("tools") or [],
            "tool_outputs": readable.get("tool_outputs") or [],
        }

    # Every node skipped the model (skip_gpu_arch): a SKIPPED job, as MAD records it, not a failure. Where only some
    # did, the others stopped for them (the ABORT marker), and the job failed.
    if per_node and all(entry["status"] == SKIPPED for entry in per_node.values()):
        return Verdict(SKIPPED, next(iter(per_node.values()))["node_reason"] or "skip_gpu_arch", per_node)

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
            reason=f"failed and stopped the other ranks: {told or 'see its run.log'}",
        )

    root_causes = {}  # type: Dict[str, List[str]]
    collateral = {}  # type: Dict[str, List[str]]
    for node, entry in per_node.items():
        if entry["status"] == FAILURE and not entry["hang"]:
            groups = root_causes if entry["root_cause"] else collateral
            groups.setdefault(entry["reason"], []).append(f"{node} (rank {entry['rank']})")

    if any(entry["hang"] for entry in per_node.values()):
        # The hung nodes all say the same ("no rank made progress"); the finding says who everyone waited for.
        said = next(entry["reason"] for entry in per_node.values() if entry["hang"])
        summary = f"hang: {hang['summary']}" if hang and hang.get("summary") else said
        return Verdict(FAILURE, "; ".join([summary] + _describe_groups(root_causes)), per_node)

    any_metric = any(has_metric(row) for row in perf_rows)
    parts = _describe_groups(root_causes) + _describe_groups(collateral)
    if not nodes:
        parts = ["no node of the job left any result"]
    if abort_marker and not parts:
        parts = [f"the ABORT marker says: {abort_marker.get('reason') or 'no reason given'}"]
    if parts:
        if not any_metric:
            parts.append(NO_METRIC_REASON)
        return Verdict(FAILURE, "; ".join(parts), per_node)
    if not any_metric:
        return Verdict(FAILURE, NO_METRIC_REASON, per_node)
    metric_rows = sum(1 for row in perf_rows if has_metric(row))
    return Verdict(SUCCESS, f"{metric_rows} performance row(s) found, no node failed", per_node)


def load_node_status(path: str) -> Optional[Dict[str, Any]]:
    """A node's status.json as ``decide_verdict`` takes it: None when missing, ``{STATUS_FILE_ERROR: why}`` when
    it exists but cannot be read or is not a JSON object."""
    try:
        status = safe_files.read_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {STATUS_FILE_ERROR: str(exc)}
    if not isinstance(status, dict):
        return {STATUS_FILE_ERROR: "not a JSON object"}
    return status
