"""On the real lab: what the login node can check is refused before sbatch (issue 58), and SLURM's own queue shows
it. Each submission below carries one mistake and a job name of its own (SBATCH_JOB_NAME, which sbatch takes over
the script's line); after the refusal (exit 2, the fix named) `squeue` holds no job of that name, neither the job
nor its collect job. The unit side (tests/unit/slurm_multi/submission/test_refused_before_sbatch.py) covers every
refusal against a fake sbatch; this one proves the real queue stays empty."""

import os
import subprocess
import uuid

import pytest

from tests.support.ansible import BIN

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

# (what is wrong, extra argv, extra environment, words the refusal must say)
MISTAKES = [
    ("a setting of the wrong type", ["-e", "hang_timeout=five"], {}, ["hang_timeout 'five' is not a number"]),
    ("a hostlist SLURM cannot read", ["--nodelist", "node[1-"], {}, ["--nodelist"]),
    ("a runtime slurm-multi does not know", ["-e", "container_runtime=podman"], {}, ["docker, charliecloud"]),
    ("a site file that is not there", [], {"SLURM_MULTI_SITE_CONFIG": "/nonexistent/site.yml"}, ["/nonexistent"]),
    ("a tag that selects no card", ["--tags", "no_such_model_tag"], {}, ["no_such_model_tag"]),
]


def _queued(name: str) -> list:
    listed = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, check=True)
    return listed.stdout.split()


@pytest.mark.parametrize("what, argv, environ, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_refused_submission_leaves_nothing_in_slurms_queue(lab_cluster, tmp_path, what, argv, environ, words):
    name = f"refused-{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, SBATCH_JOB_NAME=name, **environ)
    args = [str(BIN / "slurm-multi"), "submit", "-N", "2", "--results-dir", str(tmp_path / "results")]
    if "--tags" not in argv:
        args += ["--tags", "dummy"]
    refused = subprocess.run(args + argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, f"{what}: {said}"
    for word in words:
        assert word in said, f"{what}: {said}"
    assert _queued(name) == [], f"{what}: SLURM queued {_queued(name)}"
    assert not (tmp_path / "results").exists(), f"{what}: the results dir was made"
