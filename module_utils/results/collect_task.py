"""The collect_results task's work and result, shared by its module (library/collect_results.py) and its action
plugin (plugins/action/collect_results.py), which the pipeline runs in Ansible's own worker on the controller."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import collect_job_or_sweep
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import record_path

ARGUMENT_SPEC = dict(
    results_dir=dict(type="path", required=True),
    job_id=dict(type="str", required=True),
    attempt=dict(type="int"),
    model=dict(type="dict", default={}),
    nodes=dict(type="list", elements="str", default=[]),
    force=dict(type="bool", default=False),
    container_runtime=dict(type="str", default=""),
)

PERF_ROWS_RETURNED = 1000
_ROW_KEYS = ("model", "performance", "metric", "status")


def collect_results(params: Mapping[str, Any], check_mode: bool) -> Tuple[Dict[str, Any], List[str]]:
    """Collect the job's attempt into its record (nothing written in check mode): the task's result and its
    warnings."""
    collection = collect_job_or_sweep(
        params["results_dir"],
        params["job_id"],
        model=params["model"],
        nodes=params["nodes"],
        force=params["force"],
        write=not check_mode,
        attempt=params["attempt"],
        container_runtime=params["container_runtime"],
    )
    record = collection.record
    warnings = list(record.get("warnings") or [])
    warnings += [f"perf.csv left out {skipped['path']}: {skipped['reason']}" for skipped in collection.perf_csv_skipped]
    warnings += [
        f"results CSV {candidate['path']} skipped: {candidate['skipped']}"
        for candidate in record.get("results_csv_candidates", [])
        if candidate.get("skipped")
    ]
    rows = record.get("rows", [])
    result = dict(
        changed=collection.changed,
        status=record.get("status"),
        reason=record.get("reason"),
        record_path=collection.record_path,
        job_record_path=record_path(params["results_dir"], params["job_id"]),
        attempt=collection.attempt,
        perf_rows=[{key: row.get(key, "") for key in _ROW_KEYS} for row in rows[:PERF_ROWS_RETURNED]],
        perf_rows_total=len(rows),
        per_node=record.get("per_node", {}),
        metric_source=record.get("metric_source", ""),
        results_csv_candidates=record.get("results_csv_candidates", []),
    )
    return result, warnings
