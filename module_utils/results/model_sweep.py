"""A sweep: several models run one after another in one allocation, each a job of its own, ``<job_id>.<k>``
(docs/sweeps.md). Controller side: the records are written under the results lock."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import (
    FAILURE,
    SKIPPED,
    SUCCESS,
    JobLayoutError,
    validate_job_id,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import (
    JobCollection,
    collect_job,
    write_failure_record,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import (
    load_record,
    record_path,
    write_attempt_record,
)

SWEEP_FILE = "sweep.json"
# The key a sweep's record (and only a sweep's) has: perf.csv takes its rows from the models' records instead.
SWEEP_KEY = "sweep"


def sub_job_id(job_id: str, index: int) -> str:
    """The job ID of a sweep's ``index``-th model (from 1): ``<job_id>.<index>``."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 1:
        raise JobLayoutError(f"a sweep's model index is counted from 1, not {index!r}")
    return validate_job_id(f"{validate_job_id(job_id)}.{index}")


def sweep_plan_path(results_dir: str, job_id: str, attempt: int) -> str:
    """``<results_dir>/<job_id>/attempt-<N>/sweep.json``."""
    return os.path.join(job_layout.attempt_dir(results_dir, job_id, attempt), SWEEP_FILE)


def new_sweep_plan(job_id: str, attempt: int, cards: Sequence[Mapping[str, Any]], stop_on_failure: bool) -> dict:
    """The plan of a sweep over ``cards`` (one per image, in the order they run)."""
    models = [
        {"index": index, "job_id": sub_job_id(job_id, index), "model": str(card.get("name", "")), "card": dict(card)}
        for index, card in enumerate(cards, start=1)
    ]
    return {
        "job_id": validate_job_id(job_id),
        "attempt": job_layout.validate_attempt(attempt),
        "models": models,
        "stop_on_failure": bool(stop_on_failure),
    }


def _same_image(card: Mapping[str, Any], failure: Mapping[str, Any]) -> bool:
    dockerfile = os.path.basename(str(card.get("dockerfile") or ""))
    return card.get("name") == failure.get("model") and dockerfile == os.path.basename(str(failure.get("dockerfile")))


def plan_after_build(
    plan: Mapping[str, Any], built: Sequence[Mapping[str, Any]], failures: Sequence[Mapping[str, Any]]
) -> dict:
    """The plan once the first run has built: the images built (``built``: the manifest's cards, in its order),
    then each image that failed to build (``failures``), recorded not run with the build's error. The first model
    keeps its place when its own image failed (its run is over, recorded FAILURE). ``manifest_index`` is a model's
    image in the manifest, which names only the images built (and only those the nodes' context kept)."""
    first = plan["models"][0]
    first_failed = any(_same_image(first["card"], failure) for failure in failures)
    entries = [(first["card"], None, None)] if first_failed else []
    entries += [(card, position, None) for position, card in enumerate(built)]
    for failure in failures:
        if first_failed and _same_image(first["card"], failure):
            continue
        card = next((m["card"] for m in plan["models"] if _same_image(m["card"], failure)), None)
        card = card or {"name": failure.get("model"), "dockerfile": failure.get("dockerfile")}
        entries.append((card, None, f"not run: its image failed to build: {failure.get('error')}"))
    new_plan = new_sweep_plan(
        plan["job_id"], plan["attempt"], [card for card, _, _ in entries], plan["stop_on_failure"]
    )
    for model, (_, position, not_run) in zip(new_plan["models"], entries):
        if position is not None:
            model["manifest_index"] = position
        if not_run:
            model["not_run"] = not_run
    return new_plan


def write_sweep_plan(results_dir: str, plan: Mapping[str, Any]) -> str:
    """Write the plan into the sweep's attempt dir (made when missing); its path."""
    path = sweep_plan_path(results_dir, plan["job_id"], plan["attempt"])
    results_dir_trust.make_job_dirs(os.path.dirname(path), results_dir)
    safe_files.write_json_atomically(path, dict(plan))
    return path


def read_sweep_plan(results_dir: str, job_id: str, attempt: int) -> Optional[Dict[str, Any]]:
    """The sweep's plan, None when the job is no sweep (no sweep.json)."""
    path = sweep_plan_path(results_dir, job_id, attempt)
    try:
        plan = safe_files.read_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JobLayoutError(
            f"{path} cannot be read as a sweep's plan ({exc}); move it aside and collect again"
        ) from None
    if not isinstance(plan, dict) or not isinstance(plan.get("models"), list):
        raise JobLayoutError(f"{path} is not a sweep's plan (no 'models' list); move it aside and collect again")
    return plan


def cards_of_manifest(manifest: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The card of each image of a build manifest, in its order: a card with two Dockerfile variants is two, each
    naming the Dockerfile its image was built from (its perf rows' docker_file)."""
    models = manifest.get("built_models") if isinstance(manifest, Mapping) else None
    images = manifest.get("built_images") if isinstance(manifest, Mapping) else None
    if not isinstance(models, Mapping) or not isinstance(images, Mapping):
        raise JobLayoutError("the build manifest has no built_models and built_images objects")
    cards = []
    for name, card in models.items():
        image = images.get(name) if isinstance(images.get(name), Mapping) else {}
        cards.append(dict(card, dockerfile=image["dockerfile"]) if image.get("dockerfile") else dict(card))
    return cards


def sweep_verdict(entries: Sequence[Mapping[str, Any]]) -> tuple:
    """The sweep's (status, reason) from its models' verdicts: SUCCESS when every model succeeded (or was
    skipped; SKIPPED when all were), else FAILURE naming each model that did not."""
    statuses = [entry.get("status") for entry in entries]
    if not entries:
        return FAILURE, "the sweep ran no model"
    if all(status == SKIPPED for status in statuses):
        return SKIPPED, ""
    failed = [entry for entry in entries if entry.get("status") not in (SUCCESS, SKIPPED)]
    if not failed:
        return SUCCESS, ""
    total = len(entries)
    parts = [
        f"model {entry['index']} of {total} {entry['model']} (job {entry['job_id']}): "
        + (entry.get("reason") or "FAILURE")
        for entry in failed
    ]
    return FAILURE, f"{len(failed)} of {total} models failed: " + "; ".join(parts)


def record_sweep(
    results_dir: str,
    job_id: str,
    attempt: int,
    nodes: Sequence[str] = (),
    failure_reason: Optional[str] = None,
    slurm_state: Optional[str] = None,
    not_run_reason: Optional[str] = None,
    container_runtime: str = "",
) -> Dict[str, Any]:
    """Write the sweep's record (unless it has one) and return it as on disk: every model's verdict, FAILURE for one
    that never ran; with ``failure_reason`` the sweep and every model without a record fail with it."""
    job_id = validate_job_id(job_id)
    attempt = job_layout.validate_attempt(attempt)
    existing = load_record(results_dir, job_id, attempt)
    if existing is not None:
        return existing
    plan = read_sweep_plan(results_dir, job_id, attempt)
    if plan is None:
        raise JobLayoutError(
            f"job {job_id} attempt {attempt} is no sweep: {sweep_plan_path(results_dir, job_id, attempt)} is missing"
        )
    entries = []
    rows = []  # type: List[Dict[str, Any]]
    extra_columns = []  # type: List[str]
    for model in plan["models"]:
        record = load_record(results_dir, model["job_id"], attempt)
        if record is None:
            ran = os.path.isdir(job_layout.attempt_dir(results_dir, model["job_id"], attempt))
            if ran and not failure_reason:
                # Cut short before its own collect: what its nodes left decides.
                record = collect_job(
                    results_dir,
                    model["job_id"],
                    model=model.get("card"),
                    nodes=nodes,
                    attempt=attempt,
                    container_runtime=container_runtime,
                )
            else:
                why = failure_reason or model.get("not_run") or not_run_reason or "not run: the sweep stopped before it"
                record = write_failure_record(
                    results_dir,
                    model["job_id"],
                    why,
                    slurm_state=slurm_state,
                    model=model.get("card"),
                    nodes=nodes,
                    attempt=attempt,
                    container_runtime=container_runtime,
                )
            record = record.record
        entries.append(
            {
                "index": model["index"],
                "job_id": model["job_id"],
                "model": model["model"],
                "status": record.get("status"),
                "reason": record.get("reason", ""),
            }
        )
        rows.extend(record.get("rows") or [])
        extra_columns.extend(name for name in record.get("extra_columns") or [] if name not in extra_columns)
    status, reason = sweep_verdict(entries)
    if failure_reason:
        status = FAILURE
        reason = failure_reason + (f"; {reason}" if reason else "")
    sweep_record = {
        "job_id": job_id,
        "attempt": attempt,
        "status": status,
        "reason": reason,
        "slurm_state": slurm_state,
        "nodes": list(nodes),
        "per_node": {},
        "metric_source": "",
        "abort_marker": None,
        "results_csv_candidates": [],
        "extra_columns": extra_columns,
        "rows": rows,
        SWEEP_KEY: entries,
        "collected_at": time.time(),
    }
    written, _, _ = write_attempt_record(results_dir, sweep_record, overwrite=False)
    return written


def collect_job_or_sweep(
    results_dir: str,
    job_id: str,
    model: Optional[Mapping[str, Any]] = None,
    nodes: Sequence[str] = (),
    force: bool = False,
    write: bool = True,
    attempt: Optional[int] = None,
    container_runtime: str = "",
) -> JobCollection:
    """`collect_job`, or for a sweep's own job (its plan in the attempt dir) the sweep's record: collecting a sweep
    by its job ID (the pipeline cut short, `slurm-multi collect`) must never decide it from its empty nodes dir."""
    job_id = validate_job_id(job_id)
    number = job_layout.latest_attempt(results_dir, job_id) if attempt is None else job_layout.validate_attempt(attempt)
    if write and not force and read_sweep_plan(results_dir, job_id, number) is not None:
        existed = load_record(results_dir, job_id, number) is not None
        record = record_sweep(results_dir, job_id, number, nodes=nodes, container_runtime=container_runtime)
        return JobCollection(record, record_path(results_dir, job_id, number), not existed, [], number)
    return collect_job(
        results_dir,
        job_id,
        model=model,
        nodes=nodes,
        force=force,
        write=write,
        attempt=attempt,
        container_runtime=container_runtime,
    )
