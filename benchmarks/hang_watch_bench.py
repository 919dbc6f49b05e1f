"""The hang watchdog's cost: one node's sample of its container, and rank 0's judgement of N nodes' progress files.

    .venv/bin/python -m benchmarks.hang_watch_bench [--repeat 20]

A node's sample is one `docker top` and a /proc read per process of its container: measured on a real lab container
(node1's daemon) running Python. Rank 0 reads every node's progress.json each sample: measured for 3 to 1024 nodes'
files in one directory tree on this machine's disk (a shared filesystem adds its round trip per file; at 1024 nodes
and one sample each 10 s, that is the budget to compare with).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import (
    PROGRESS_FILE,
    HangWatch,
    NodeProgress,
)
from slurm_multi.lab.pytorch import PYTORCH_BASE, ensure_pytorch_base

CONTAINER = "slurm-multi-hang-watch-bench"


def _median_ms(samples):
    return f"{statistics.median(samples) * 1000:.1f} ms (min {min(samples) * 1000:.1f}, max {max(samples) * 1000:.1f})"


def node_sample(repeat: int) -> None:
    ensure_pytorch_base(["node1"])
    node_docker = ["srun", "-w", "node1", "-N1", "docker"]
    subprocess.run([*node_docker, "rm", "-f", CONTAINER], capture_output=True)
    subprocess.run(
        [*node_docker, "run", "-d", "--name", CONTAINER, PYTORCH_BASE, "python3", "-c", "import time; time.sleep(600)"],
        check=True,
        capture_output=True,
    )
    try:
        # The sample runs where the run module does: inside node1, against its own daemon.
        script = (
            "import time, statistics\n"
            "from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import NodeProgress\n"
            f"progress = NodeProgress({CONTAINER!r}, '/dev/null', '/tmp/hang-watch-bench-progress.json', 'node1', 0)\n"
            "took = []\n"
            f"for _ in range({repeat}):\n"
            "    started = time.perf_counter()\n"
            "    progress.sample(time.monotonic())\n"
            "    took.append(time.perf_counter() - started)\n"
            "print(statistics.median(took), min(took), max(took))\n"
        )
        done = subprocess.run(
            ["srun", "-w", "node1", "-N1", sys.executable, "-c", script],
            check=True,
            capture_output=True,
            text=True,
        )
        median, low, high = (float(value) for value in done.stdout.split())
        print(
            f"one node's sample (docker top + /proc, a Python container): {median * 1000:.1f} ms "
            f"(min {low * 1000:.1f}, max {high * 1000:.1f}), {repeat} samples"
        )
    finally:
        subprocess.run([*node_docker, "rm", "-f", CONTAINER], capture_output=True)


def rank0_judgement(repeat: int) -> None:
    for nodes in (3, 8, 64, 256, 1024):
        with tempfile.TemporaryDirectory() as root:
            node_dirs = {f"node{index}": os.path.join(root, f"node{index}") for index in range(nodes)}
            for node, path in node_dirs.items():
                os.makedirs(path)
                NodeProgress("none", "/dev/null", os.path.join(path, PROGRESS_FILE), node, 0).sample(0.0)
            watch = HangWatch("none", "/dev/null", node_dirs, "node0", 0, hang_timeout=300, now=0.0)
            watch.progress.sample = lambda now: False  # the judgement alone: node0's own sample is measured above
            took = []
            for index in range(repeat):
                started = time.perf_counter()
                watch.tick(now=float(index * 100))
                took.append(time.perf_counter() - started)
            print(f"rank 0's judgement of {nodes:>4} nodes' progress files: {_median_ms(took)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    node_sample(args.repeat)
    rank0_judgement(args.repeat)


if __name__ == "__main__":
    main()
