"""`make demo`: the main job on the lab cluster.

A 3-node `dummy_lastrank` run submitted as a user would (`slurm-multi submit --wait`): rank 0 builds the sample
image, the workers load it from the shared tar cache, the barrier releases them, the containers run, and only the
last rank (node3) prints a tokens/sec figure, which ends up in the perf record. Exit code: the verdict.
"""

import sys

from slurm_multi import cli

DEMO_RESULTS_DIR = "/tmp/slurm-multi-demo"


def main() -> int:
    return cli.main(["submit", "--nodes", "3", "--tags", "dummy_lastrank", "--results-dir", DEMO_RESULTS_DIR, "--wait"])


if __name__ == "__main__":
    sys.exit(main())
