"""benchmarks/barrier_bench.py still runs end to end (tiny sizes, our barrier only, loopback): it cannot rot unseen.

The figures' values are not checked here (benchmarks/README.md holds them), but their shape is: every simulated
worker released in every configuration, and figures that are finite, positive and consistent with each other.
"""

import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HEADINGS = [
    "released",
    "connect ms",
    "joined ms",
    "release p50 ms",
    "release max ms",
    "worst max ms",
    "total ms",
    "rank 0 CPU ms",
]


def run_the_benchmark():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.barrier_bench",
            "--sizes",
            "3",
            "8",
            "--repeat",
            "2",
            "--processes",
            "2",
            "--idle",
            "2",
            "--no-torch",
            "--no-netns",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    return completed.stdout


def test_the_barrier_benchmark_releases_every_worker_and_prints_consistent_figures():
    output = run_the_benchmark()
    header = next(line for line in output.splitlines() if line.startswith("barrier "))
    assert all(heading in header for heading in HEADINGS), header
    rows = [line.split() for line in output.splitlines() if line.startswith("rank_barrier")]
    assert [(row[1], row[2]) for row in rows] == [("3", "0"), ("8", "0"), ("3", "2"), ("8", "2")], output
    for row in rows:
        workers = int(row[1])
        figures = dict(zip(HEADINGS, map(float, row[3:]), strict=False))
        assert len(figures) == len(HEADINGS), row
        assert figures["released"] == workers, f"not every simulated worker was released: {row}"
        assert all(math.isfinite(value) and value > 0 for value in figures.values()), row
        assert figures["release p50 ms"] <= figures["release max ms"] <= figures["worst max ms"], row
        assert figures["joined ms"] <= figures["total ms"], row
