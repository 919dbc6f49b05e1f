#!/usr/bin/env python3
"""How fast the postprocessing stage picks the best results CSV of a large job, and how much memory it takes.

A 64-node job where every node left a 100k-row multiple-results CSV (``model,performance,metric`` and one extra
column; each node has a different share of empty performance cells, so one worker is the clear winner) is laid
out in a temp dir. Each measurement runs in its own child process, so its peak RSS (``ru_maxrss``) is its own:

* ``baseline``: the child imports pandas and the collection code, nothing else;
* ``pick``: ``select_best_results_csv`` over the 64 CSVs (target: under 5 s);
* ``collect``: the whole ``collect_job`` (pick, verdict, a 100k-row record JSON and CSV, perf.csv);
* ``scan``: ``scan_log_file`` over a 500k-line Megatron-like log (collect scans every node's run.log).

Run from the repository's root: ``.venv/bin/python -m benchmarks.aggregate_bench [--nodes 64] [--rows 100000]``
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICK_TARGET_SECONDS = 5.0
LOG_LINES = 500_000
MEGATRON_LINE = (
    "[rank15]: iteration {0:8d}/ 1000000 | consumed samples: {1} | elapsed time per iteration (ms): 1234.5 | "
    "learning rate: 1.000000E-04 | lm loss: 2.345678E+00 | loss scale: 1.0 | grad norm: 0.512 | "
    "number of skipped iterations: 0 | number of nan iterations: 0 |\n"
)


def write_job(results_dir: Path, job_id: str, nodes: int, rows: int) -> Path:
    """Lay out a job whose every node left a status.json and a `rows`-row results CSV."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(7)
    models = np.array([f"case_{i}" for i in range(rows)], dtype=object)
    values = np.char.mod("%.3f", rng.uniform(100.0, 20000.0, rows)).astype(object)
    for rank in range(nodes):
        node_dir = results_dir / job_id / "nodes" / f"node{rank:03d}"
        node_dir.mkdir(parents=True)
        # rank r leaves (r+1)/nodes of its performance cells filled: the last rank is the richest.
        filled = rng.random(rows) < (rank + 1) / nodes
        frame = pd.DataFrame(
            {
                "model": models,
                " performance": np.where(filled, values, ""),  # a leading-space header, as models write them
                "metric": "tok/s",
                "batch_size": "32",
            }
        )
        frame.to_csv(node_dir / "perf_bench.csv", index=False)
        status = {
            "node": node_dir.name,
            "rank": rank,
            "status": "SUCCESS",
            "exit_code": 0,
            "error_pattern": None,
            "aborted_by_rank": None,
            "cancelled": False,
            "timed_out": False,
            "perf_lines": 0,
            "reason": "",
            "started_at": 0.0,
            "ended_at": 1.0,
        }
        (node_dir / "status.json").write_text(json.dumps(status))
        (node_dir / "run.log").write_text("training\n")
    with open(results_dir / "megatron.log", "w") as log:
        for iteration in range(LOG_LINES):
            log.write(MEGATRON_LINE.format(iteration, iteration * 128))
            if iteration % 1000 == 999:
                log.write(f"[rank15]: performance: {10000 + iteration % 7}.5 tokens/sec/GPU\n")
    return results_dir / job_id


def child(mode: str, results_dir: str, job_id: str) -> None:
    """One measurement, in this process; prints its figures as JSON."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_csv import select_best_results_csv
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import scan_log_file

    job_dir = Path(results_dir) / job_id
    candidates = sorted(str(path) for path in job_dir.glob("nodes/*/perf_bench.csv"))
    started = time.perf_counter()
    cpu_started = time.process_time()
    figures = {}
    if mode == "pick":
        best, report = select_best_results_csv(candidates)
        figures.update(best=os.path.relpath(best, results_dir), candidates=len(report))
    elif mode == "collect":
        collection = collect_job(results_dir, job_id, model={"name": "bench", "multiple_results": "perf_bench.csv"})
        figures.update(status=collection.record["status"], rows=len(collection.record["rows"]))
    elif mode == "scan":
        scan = scan_log_file(str(Path(results_dir) / "megatron.log"))
        figures.update(perf_lines=len(scan.perf_lines))
    figures["seconds"] = time.perf_counter() - started
    # CPU time beside wall time: on a shared machine the wall clock also measures the neighbours.
    figures["cpu_seconds"] = time.process_time() - cpu_started
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps(figures))


def describe(label: str, figures: dict, detail: str = "") -> str:
    line = (
        f"{label:<32} {figures['seconds']:6.2f} s wall, {figures['cpu_seconds']:6.2f} s CPU, "
        f"peak RSS {figures['peak_rss_mb']:6.1f} MB"
    )
    return line + ("; " + detail if detail else "")


def measure(mode: str, results_dir: Path, job_id: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.aggregate_bench", "--child", mode]
        + ["--results-dir", str(results_dir), "--job-id", job_id],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--child", choices=["baseline", "pick", "collect", "scan"], help=argparse.SUPPRESS)
    parser.add_argument("--results-dir", help=argparse.SUPPRESS)
    parser.add_argument("--job-id", default="4242", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.results_dir, args.job_id)
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="slurm-multi-aggregate-bench-"))
    try:
        started = time.perf_counter()
        job_dir = write_job(workdir, args.job_id, args.nodes, args.rows)
        size_mb = sum(path.stat().st_size for path in job_dir.glob("nodes/*/perf_bench.csv")) / 2**20
        print(
            f"generated {args.nodes} node CSVs x {args.rows} rows ({size_mb:.0f} MB) "
            f"in {time.perf_counter() - started:.1f} s"
        )
        baseline = measure("baseline", workdir, args.job_id)
        pick = measure("pick", workdir, args.job_id)
        collect = measure("collect", workdir, args.job_id)
        scan = measure("scan", workdir, args.job_id)
        log_mb = (workdir / "megatron.log").stat().st_size / 2**20
        print(describe("baseline (imports only)", baseline))
        print(describe(f"pick best of {pick['candidates']} CSVs", pick, "picked " + pick["best"]))
        verdict = "met" if pick["seconds"] < PICK_TARGET_SECONDS else "MISSED"
        print(f"  target: under {PICK_TARGET_SECONDS:.0f} s wall: {verdict}")
        print(describe("whole collect_job", collect, f"{collect['rows']} rows, {collect['status']}"))
        print(describe(f"scan a {log_mb:.0f} MB, {LOG_LINES}-line log", scan, f"{scan['perf_lines']} perf lines"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
