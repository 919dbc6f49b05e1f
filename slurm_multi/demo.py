"""`make demo`: the main job on the lab cluster.

Until the pipeline lands, it proves the lab: a 3-node sbatch job whose steps report each node's hostname and
Docker daemon.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """#!/bin/sh
srun -l sh -c 'echo "$(hostname) docker=$(docker info --format {{.DockerRootDir}})"'
"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="slurm-multi-demo-", dir="/tmp") as tmp:
        script = Path(tmp) / "demo.sbatch"
        script.write_text(SCRIPT)
        out = Path(tmp) / "demo.out"
        result = subprocess.run(["sbatch", "-N", "3", "--wait", "-o", str(out), str(script)], text=True)
        print(out.read_text() if out.exists() else "(no job output)")
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
