"""A 3-node `ansible all -m ping` through the srun connection vs the local connection, side by side.

Run on the lab cluster (`slurm-multi lab up`): python -m benchmarks.ping_bench [--repeat 5]
The script re-runs itself inside one `salloc -N 3` allocation and alternates the two variants there, so only the
connection differs and drift hits both alike.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VARIANTS = {
    "srun (allocation inventory)": [f"{BIN}/ansible", "all", "-m", "ansible.builtin.ping", "-f", "3", "-o"],
    "local (same 3 hosts)": [
        f"{BIN}/ansible",
        "all",
        "-i",
        "node1,node2,node3,",
        "-c",
        "local",
        "-m",
        "ansible.builtin.ping",
        "-f",
        "3",
        "-o",
        "-e",
        f"ansible_python_interpreter={BIN}/python",
    ],
}


def measure(repeat: int) -> dict:
    times = {name: [] for name in VARIANTS}
    for _ in range(repeat):
        for name, argv in VARIANTS.items():
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inside:
        return subprocess.run(
            ["salloc", "-N", "3", "--quiet", sys.executable, __file__, "--inside", "--repeat", str(args.repeat)]
        ).returncode
    times = measure(args.repeat)
    print(f"3-node `ansible all -m ping` in allocation {os.environ.get('SLURM_JOB_ID')}, {args.repeat} runs each")
    for name, samples in times.items():
        print(
            f"  {name:<30} median {statistics.median(samples):.2f}s  min {min(samples):.2f}s  max {max(samples):.2f}s"
        )
    srun, local = (statistics.median(samples) for samples in times.values())
    print(f"  srun / local: {srun / local:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
