"""A sweep of 3 models in one allocation against 3 separate submissions, on the lab (issue 17).

    python -m benchmarks.sweep_bench [--mode push|pull] [--repeat 1] [--models A,B,C]

Both variants run the same three sample models on 3 nodes with warm images (a first, unmeasured sweep builds them
on node1 and they reach every node):

* sweep: one `slurm-multi submit --tags A B C --wait`: one sbatch, one allocation, one collect job;
* separate: `slurm-multi submit --tags A --wait`, then B, then C: three sbatch jobs, allocations and collect jobs.

Each is timed from the first submit to the last verdict (wall: what the user waits, with `--wait`'s polling), and
as the jobs' own run time in SLURM (StartTime to EndTime, summed over the variant's main jobs; no queue time, no
polling). `--no-exclusive`, so that other lab jobs running at the same time do not queue these behind them.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.e2e_bench import job_elapsed


def submit(tags: list, results: Path, mode: str) -> str:
    """One `slurm-multi submit --wait` of ``tags`` on 3 nodes; its job ID (the run must succeed)."""
    argv = [sys.executable, "-m", "slurm_multi.cli", "submit", "-N", "3", "--no-exclusive", "--mode", mode]
    argv += ["--results-dir", str(results), "--wait", "--tags", *tags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-4000:] + out.stderr[-2000:])
    return out.stdout.split("Submitted job ")[1].split()[0]


def measure(variant: str, models: list, work: Path, mode: str) -> dict:
    results = work / f"results-{variant}-{time.monotonic_ns()}"
    start = time.perf_counter()
    if variant == "sweep":
        jobs = [submit(models, results, mode)]
    else:
        jobs = [submit([model], results, mode) for model in models]
    wall = time.perf_counter() - start
    return {"wall": wall, "job": sum(job_elapsed(job) for job in jobs), "jobs": len(jobs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="push", choices=("push", "pull"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--models", default="dummy,dummy_lastrank,dummy_multiple_results")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    models = args.models.split(",")
    work = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    warm = work / "warm"
    submit(models, warm, args.mode)  # builds and spreads the images: both variants then run warm
    samples = {"sweep": [], "separate": []}
    for _ in range(args.repeat):
        for variant in ("sweep", "separate"):  # taking turns: the lab's load drifts
            try:
                samples[variant].append(measure(variant, models, work, args.mode))
            except RuntimeError as exc:
                print(f"{variant}: {exc}", file=sys.stderr)
    print(f"{len(models)} models on 3 nodes, {args.mode} mode, warm images, {args.repeat} repeat(s), median:")
    print(f"{'variant':<10} {'sbatch jobs':>11} {'wall s':>8} {'SLURM run time s':>17}")
    for variant, runs in samples.items():
        if runs:
            wall = statistics.median(run["wall"] for run in runs)
            job = statistics.median(run["job"] for run in runs)
            print(f"{variant:<10} {runs[0]['jobs']:>11} {wall:>8.1f} {job:>17.1f}")
    if args.json:
        args.json.write_text(json.dumps(samples, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
