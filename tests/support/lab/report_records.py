"""Hand-made job records for report tests: what collect writes (module_utils/results/collection.py), with a stage
timeline, for a results dir of the test's own."""

import json
from pathlib import Path

NODES = ("node1", "node2", "node3")


def job_record(job_id, model, performance, *, status="SUCCESS", metric="tokens/sec", recorded_at=1.8e9, nodes=NODES):
    """A job's record: every node's verdict and steps (node3 loads slowest), one perf row."""
    start = recorded_at - 100
    timeline = {}
    for rank, node in enumerate(nodes):
        steps = {"preflight": (0, 2)}
        steps.update({"build": (2, 8), "publish": (8, 10)} if rank == 0 else {"load": (10, 12 + 20 * (rank == 2))})
        steps.update({"barrier": (12 + 20 * (rank == 2), 33), "container_start": (33, 34), "run": (34, 60)})
        timeline[node] = {step: {"start": start + a, "end": start + b} for step, (a, b) in steps.items()}
    row_status = status if status != "SUCCESS" or performance != "" else "FAILURE"
    return {
        "job_id": job_id,
        "attempt": 0,
        "status": status,
        "reason": "1 performance row(s) found, no node failed" if status == "SUCCESS" else "node2 failed: exit 3",
        "slurm_state": None,
        "nodes": list(nodes),
        "per_node": {
            node: {"rank": rank, "status": status, "reason": "", "root_cause": status != "SUCCESS" and rank == 1}
            for rank, node in enumerate(nodes)
        },
        "rows": [
            {
                "model": model,
                "performance": str(performance),
                "metric": metric,
                "nnodes": str(len(nodes)),
                "status": row_status,
            }
        ],
        "timeline": timeline,
        "barrier_wait": {node: steps["barrier"]["end"] - steps["barrier"]["start"] for node, steps in timeline.items()},
        "collected_at": recorded_at,
    }


def write_records(results_dir: Path, *records) -> Path:
    """Each record as records/<job_id>.json (and its perf rows as .csv), perf.csv regenerated as collect does;
    returns the results dir."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import regenerate_perf_csv

    records_dir = results_dir / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    for record in records:
        (records_dir / f"{record['job_id']}.json").write_text(json.dumps(record))
        header = "model,nnodes,performance,metric,status\n"
        lines = "".join(
            f"{row['model']},{row['nnodes']},{row['performance']},{row['metric']},{row['status']}\n"
            for row in record["rows"]
        )
        (records_dir / f"{record['job_id']}.csv").write_text(header + lines)
    regenerate_perf_csv(str(results_dir))
    return results_dir
