"""Retrying a job without the nodes its failure is attributable to (`submit --retries N`).

The afterany collect job decides once the job is recorded, so a retry happens after the submitting shell is gone
too; the rule (a node's fault, or the model's?) is module_utils/results/retry_cause.py's. A retry resubmits the very
job (same private dir, vars, secrets and SLURM options) with the blamed nodes added to ``--exclude``. Each record gets
``retries``: one entry per attempt so far, so the last job's record names every attempt. The plan lives in the
private dir (``retries.json``).
"""

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import (
    load_record,
    write_attempt_record,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.retry_cause import (
    NODES,
    attempt_summary,
    failure_cause,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_json_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    expand_nodelist,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.submission import sbatch
from slurm_multi.submission.sbatch import SbatchError, SlurmOptions
from slurm_multi.submission.secrets import without_secrets

RETRY_PLAN_FILE_NAME = "retries.json"
# A job's environment holds its own SLURM_* variables: a job queued from the collect job must not inherit them
# (slurm-multi's own SLURM_MULTI_* settings stay).
_SLURM_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")


def checked_retries(retries: Any) -> int:
    """``retries`` as a whole number 0 or more, else SlurmMultiError saying so."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise SlurmMultiError(f"--retries must be a whole number, 0 or more (got {retries!r})")
    return retries


def write_retry_plan(
    private_dir: Path,
    retries: int,
    slurm: SlurmOptions,
    mode: str,
    sweep: bool,
    results_dir: Path,
    root: Path,
    node_selection: Mapping[str, Any] | None = None,
) -> None:
    """The job's retry plan, in its private dir: what a retry resubmits and how many retries remain.
    ``node_selection``: what `submit --preflight` found (slurm_multi.submission.node_selection), for the job's
    record."""
    plan = {
        "node_selection": dict(node_selection) if node_selection else None,
        "retries": retries,
        "slurm": asdict(slurm),
        "mode": mode,
        "sweep": sweep,
        "results_dir": str(results_dir),
        "root": str(root),
        "attempts": [],
    }
    write_json_atomically(str(Path(private_dir) / RETRY_PLAN_FILE_NAME), plan)


def read_retry_plan(private_dir: Path) -> dict[str, Any] | None:
    """The job's retry plan, None when it has none (submitted before retries existed, or by `run`)."""
    path = Path(private_dir) / RETRY_PLAN_FILE_NAME
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SlurmMultiError(f"cannot read the job's retry plan {path}: {exc}") from None
    return plan if isinstance(plan, dict) else None


def options_without(slurm: SlurmOptions, nodes: list[str]) -> SlurmOptions:
    """``slurm`` with ``nodes`` added to ``--exclude`` and taken out of ``--nodelist`` (dropped when emptied)."""
    try:
        excluded = expand_nodelist(slurm.exclude, "--exclude") if slurm.exclude else []
        listed = expand_nodelist(slurm.nodelist, "--nodelist") if slurm.nodelist else []
    except AllocationError as exc:
        raise SlurmMultiError(str(exc)) from None
    excluded += [node for node in nodes if node not in excluded]
    kept = [node for node in listed if node not in nodes]
    return replace(slurm, exclude=",".join(excluded) or None, nodelist=",".join(kept) or None)


def _retry_environment() -> dict[str, str]:
    environment = without_secrets(os.environ)
    return {
        name: value
        for name, value in environment.items()
        if name.startswith("SLURM_MULTI_") or not name.startswith(_SLURM_ENV_PREFIXES)
    }


def _short_of_nodes(slurm: SlurmOptions) -> str | None:
    """Why a job with these options could not start now (too few usable nodes left), None when it could."""
    try:
        usable = sbatch.usable_nodes(slurm.partition, slurm.reservation)
    except (SbatchError, AllocationError) as exc:
        return f"cannot count the nodes left ({exc})"
    left = [node for node in usable if node not in set(expand_nodelist(slurm.exclude, "--exclude"))]
    if len(left) < slurm.nodes:
        where = f"partition {slurm.partition}" if slurm.partition else "the default partition"
        return (
            f"only {len(left)} usable node(s) of {where} remain without {slurm.exclude} "
            f"({', '.join(left) or 'none'}): fewer than the {slurm.nodes} the job needs"
        )
    return None


def retry_after_job_end(results_dir: str, job_id: str, attempt: int, private_dir: Path) -> dict[str, Any] | None:
    """What the afterany collect job does after recording job ``job_id``: decide, resubmit when the rule allows
    and retries remain, and add ``retries`` to the job's record. Returns this attempt's entry (its
    ``retried_as``: the new job's and its collect job's IDs, or None), None when the job has no retry plan."""
    plan = read_retry_plan(private_dir)
    if plan is None or not (plan.get("retries") or plan.get("node_selection")):
        return None
    try:
        record = load_record(results_dir, job_id, attempt)
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    if record is None:
        return None
    if not plan.get("retries"):
        # Only `submit --preflight`'s selection to keep: which nodes were checked, chosen and left out, and why.
        write_attempt_record(results_dir, dict(record, node_selection=plan["node_selection"]), overwrite=True)
        return None
    earlier = [entry for entry in plan.get("attempts") or [] if entry.get("job_id") != job_id]
    slurm = SlurmOptions(**plan["slurm"])
    cause = failure_cause(record)
    why = cause.why
    retried_as = None
    if cause.kind == NODES:
        if len(earlier) >= plan["retries"]:
            why += f"; not retried: all {plan['retries']} retries used"
        else:
            next_slurm = options_without(slurm, list(cause.nodes))
            short = _short_of_nodes(next_slurm)
            if short:
                why += f"; not retried: {short}"
            else:
                try:
                    new_job, new_collect = sbatch.queue_job(
                        next_slurm,
                        Path(plan["root"]),
                        Path(private_dir),
                        Path(plan["results_dir"]),
                        plan["mode"],
                        bool(plan["sweep"]),
                        _retry_environment(),
                        name_suffix=f"-retry-{len(earlier) + 1}",
                    )
                    retried_as = {"job_id": new_job, "collect_job_id": new_collect}
                    why += f"; retried as job {new_job} without {', '.join(cause.nodes)}"
                    slurm = next_slurm
                except (SbatchError, sbatch.QueueError) as exc:
                    why += f"; the retry could not be submitted: {exc}"
    entry = attempt_summary(record, cause._replace(why=why), retried_as, _excluded(plan))
    chain = earlier + [entry]
    plan.update(attempts=chain, slurm=asdict(slurm))
    write_json_atomically(str(Path(private_dir) / RETRY_PLAN_FILE_NAME), plan)
    annotations = {"retries": chain}
    if plan.get("node_selection") and not earlier:  # the selection chose the first job's nodes
        annotations["node_selection"] = plan["node_selection"]
    write_attempt_record(results_dir, dict(record, **annotations), overwrite=True)
    return entry


def _excluded(plan: Mapping[str, Any]) -> list[str]:
    exclude = (plan.get("slurm") or {}).get("exclude")
    return expand_nodelist(exclude, "--exclude") if exclude else []
