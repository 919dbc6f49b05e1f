"""Why a job attempt failed, as a retry sees it: because of some nodes (retry without them), or not
(docs/nodes.md, "What is retried"). Controller side, standard library only."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SKIPPED, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import NO_STATUS_REASON

# What `failure_cause` found: the attempt did not fail; nodes are to blame; the model failed; it was stopped; or no
# node can be named.
NO_FAILURE = "none"
NODES = "nodes"
MODEL = "model"
STOPPED = "stopped"
UNATTRIBUTED = "unattributed"

# SLURM job states of a job someone or something stopped on purpose: no node to blame.
STOPPED_SLURM_STATES = frozenset(("CANCELLED", "TIMEOUT", "DEADLINE", "PREEMPTED", "OUT_OF_MEMORY"))
# Stages before the model runs; "running" counts too while the node's container never started (no exit code).
_BUILD_STAGE = "build"
# node_facts' words when a node's Docker daemon does not answer; rank_barrier's when rank 0 gave up on ranks.
_DOCKER_DOWN = re.compile(r"Docker on (\S+) is not reachable|Docker daemon not answering on ([^\s;:,()]+)")
_MISSING_RANKS = re.compile(r"missing ranks ((?:\d+(?: \([^)]*\))?(?:, )?)+)")
_RANK = re.compile(r"(\d+)(?: \(([^)]*)\))?")
# A node that stopped because another rank failed says so (pull mode's waits, the barrier at the ABORT marker).
_STOPPED_FOR_OTHER = re.compile(r"rank \d+ \([^)]+\) failed")


class FailureCause(NamedTuple):
    """``kind`` (NO_FAILURE, NODES, MODEL, STOPPED, UNATTRIBUTED); ``nodes``: each node blamed with why (NODES only);
    ``why``: one line saying what was decided and on what evidence."""

    kind: str
    nodes: Dict[str, str]
    why: str


def _model_ran_and_failed(entry: Mapping[str, Any]) -> bool:
    exit_code = entry.get("exit_code")
    log = entry.get("log") if isinstance(entry.get("log"), Mapping) else {}
    return (
        (exit_code is not None and exit_code != 0)
        or bool(entry.get("error_pattern") or log.get("error_pattern"))
        or bool(entry.get("timed_out"))
    )


def _preflight_problems(record: Mapping[str, Any]) -> Dict[str, str]:
    """The preflight section's nodes with problems: ``{node: "check: problem; ..."}``."""
    section = record.get("preflight")
    blamed = {}
    if isinstance(section, Mapping):
        for node, problems in section.items():
            if isinstance(problems, list) and problems:
                texts = [
                    str(problem.get("problem") or problem) if isinstance(problem, Mapping) else str(problem)
                    for problem in problems
                ]
                blamed[str(node)] = "preflight: " + "; ".join(texts)
    return blamed


def _missing_ranks(text: str, node_of_rank: Mapping[int, str]) -> List[Tuple[str, int]]:
    """(node, rank) of each rank a barrier message says never arrived; the node from the message, else the rank."""
    found = []
    for group in _MISSING_RANKS.findall(text or ""):
        for rank, host in _RANK.findall(group):
            node = host or node_of_rank.get(int(rank))
            if node:
                found.append((node, int(rank)))
    return found


def failure_cause(record: Mapping[str, Any]) -> FailureCause:
    """Why the attempt recorded in ``record`` failed, as a retry decides it."""
    status = record.get("status")
    if status in (SUCCESS, SKIPPED):
        return FailureCause(NO_FAILURE, {}, f"the attempt ended {status}")
    per_node = record.get("per_node") if isinstance(record.get("per_node"), Mapping) else {}
    nodes = [node for node in record.get("nodes") or per_node if node in per_node] or list(per_node)
    root = {node: per_node[node] for node in nodes if per_node[node].get("root_cause")}

    model_failed = [node for node, entry in root.items() if _model_ran_and_failed(entry)]
    if model_failed:
        why = per_node[model_failed[0]].get("reason") or "the model failed"
        labels = ", ".join(f"{node} (rank {per_node[node].get('rank')})" for node in model_failed)
        return FailureCause(MODEL, {}, f"the model itself failed on {labels} ({why}): not a node's fault")
    slurm_state = str(record.get("slurm_state") or "").split(" ")[0]
    cancelled = [node for node, entry in per_node.items() if entry.get("cancelled")]
    if slurm_state in STOPPED_SLURM_STATES or cancelled:
        what = f"SLURM state {slurm_state}" if slurm_state in STOPPED_SLURM_STATES else "cancelled (SIGTERM)"
        return FailureCause(STOPPED, {}, f"the job was stopped ({what}): no node to blame")

    blamed = _preflight_problems(record)
    node_of_rank = {entry.get("rank"): node for node, entry in per_node.items()}
    lost = [node for node, entry in root.items() if entry.get("reason") == NO_STATUS_REASON]
    own_stage_failures = [node for node, entry in root.items() if entry.get("stage") and entry.get("exit_code") is None]
    for node, entry in root.items():
        node_reason = str(entry.get("node_reason") or "")
        docker = _DOCKER_DOWN.search(node_reason)
        missing = _missing_ranks(node_reason, node_of_rank)
        if node in lost:
            if len(lost) == len(nodes):
                continue  # no node left a word: the pipeline never reached them (it failed to start, or was killed)
            blamed.setdefault(node, "left no status.json: lost or unreachable")
        elif docker:
            blamed.setdefault(docker.group(1) or docker.group(2), "Docker daemon not answering")
        elif missing:
            for lost, rank in missing:
                blamed.setdefault(lost, f"rank {rank} never reached the barrier")
        elif _STOPPED_FOR_OTHER.search(node_reason):
            continue  # collateral: the rank it names is to blame, and is a root cause itself
        elif node in own_stage_failures:
            stage = entry.get("stage")
            if len(own_stage_failures) == len(nodes) and len(nodes) > 1:
                continue  # every node failed by itself: the job's input, not a node
            if stage == _BUILD_STAGE and entry.get("rank") == 0:
                continue  # rank 0 builds and publishes from the job's input
            blamed.setdefault(node, f"the {stage} stage failed there before the model ran")
    if blamed:
        listing = "; ".join(f"{node}: {why}" for node, why in blamed.items())
        return FailureCause(NODES, blamed, f"failed because of node(s) {', '.join(blamed)} ({listing})")
    reason = record.get("reason") or "no reason recorded"
    return FailureCause(UNATTRIBUTED, {}, f"no node to blame ({reason})")


def attempt_summary(
    record: Mapping[str, Any], cause: FailureCause, retried_as: Any = None, excluded: Sequence[str] = ()
) -> Dict[str, Any]:
    """One attempt of a retried job as its records list it (``retries``): its job ID, nodes, verdict, why it
    ended, what the retry rule made of it, the nodes it ran without, and the job that retried it (or None)."""
    return {
        "job_id": record.get("job_id"),
        "nodes": list(record.get("nodes") or []),
        "status": record.get("status") or FAILURE,
        "reason": record.get("reason") or "",
        "cause": cause.kind,
        "blamed_nodes": dict(cause.nodes),
        "why": cause.why,
        "excluded": list(excluded),
        "retried_as": retried_as,
    }
