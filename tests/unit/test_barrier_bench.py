"""benchmarks/barrier_bench.py still runs end to end (tiny sizes, our barrier only, loopback): it cannot rot unseen.

The figures themselves are not checked here; benchmarks/README.md holds them.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_barrier_benchmark_runs_and_prints_its_table():
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "barrier_bench.py"), "--sizes", "3", "8", "--repeat", "1",
         "--processes", "2", "--idle", "2", "--no-torch", "--no-netns"],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    rows = [line.split() for line in completed.stdout.splitlines() if line.startswith("rank_barrier")]
    assert [(row[1], row[2]) for row in rows] == [("3", "0"), ("8", "0"), ("3", "2"), ("8", "2")], completed.stdout
    assert all(float(figure) >= 0 for row in rows for figure in row[3:])
