"""A team's results dir (module_utils/job/dir_trust.py), tried by two real users of one team (tests/support/
local_users.py): USER runs a job there, HOSTILE, a teammate, would swap it.

Without the sticky bit whoever may write a dir may rename what is in it: HOSTILE could move USER's running job dir
aside and plant an `attempt-0/ABORT` of "kind": "hang" (or records, perf.csv) that the job then takes for its own.
So a group-writable results dir without the sticky bit (2775) is refused at the job's first step, before anything
runs there; in the 3775 team dir the docs recommend, the kernel refuses HOSTILE's rename.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_group, ensure_user
from tests.support.users.user_python import run_python_as

JOB = "4242"

# The pipeline's first step on a node (node_preflight, claim_run_id): the attempt dir made, every dir on the way
# checked.
_START_JOB = """
import sys
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError, attempt_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.dir_trust import make_job_dirs
results, job = sys.argv[1:]
try:
    make_job_dirs(attempt_dir(results, job, 0), results)
except JobLayoutError as exc:
    sys.exit(str(exc))
"""

# What the job's run and collect read to learn whether the attempt was stopped.
_READ_ABORT = """
import json, sys
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import read_abort_marker
print(json.dumps(read_abort_marker(sys.argv[1])))
"""

# HOSTILE's swap: the job dir renamed aside, a dir of its own in its place with a hang marker.
_SWAP = """
import errno, json, os, sys
job_dir = sys.argv[1]
try:
    os.rename(job_dir, job_dir + ".aside")
except OSError as exc:
    sys.exit("rename: " + errno.errorcode[exc.errno])
os.makedirs(os.path.join(job_dir, "attempt-0"))
with open(os.path.join(job_dir, "attempt-0", "ABORT"), "w") as marker:
    json.dump({"rank": 1, "node": "node2", "reason": "no progress", "kind": "hang"}, marker)
"""


@pytest.fixture
def team_results_dir():
    """make(mode): a results dir root made for the team (chgrp TEAM) with `mode`, in a dir every user can reach."""
    ensure_user(USER), ensure_user(HOSTILE)  # both in TEAM
    team = ensure_group(TEAM)
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-team-"))
    base.chmod(0o755)

    def make(mode: int) -> Path:
        results = base / "results"
        results.mkdir()
        os.chown(results, 0, team.gr_gid)
        results.chmod(mode)
        return results

    yield make
    shutil.rmtree(base)


def test_a_team_dir_without_the_sticky_bit_is_refused_at_the_jobs_first_step_and_nothing_is_made(team_results_dir):
    results = team_results_dir(0o2775)

    started = run_python_as(USER, _START_JOB, str(results), JOB, home="/")

    assert started.returncode != 0
    refusal = started.stderr
    assert f"the results directory {results} is writable by its group {TEAM}" in refusal, refusal
    assert "without the sticky bit (mode 2775)" in refusal and "move what others put there aside" in refusal
    assert f"chmod 3775 {results}" in refusal and f"chmod go-w {results}" in refusal
    assert not (results / JOB).exists()


def test_in_a_sticky_team_dir_a_teammate_cannot_move_a_running_jobs_dir_aside(team_results_dir):
    results = team_results_dir(0o3775)
    assert run_python_as(USER, _START_JOB, str(results), JOB, home="/").returncode == 0

    swapped = run_python_as(HOSTILE, _SWAP, str(results / JOB), home="/")

    assert swapped.returncode != 0 and "rename: EPERM" in swapped.stderr, swapped.stderr
    read = run_python_as(USER, _READ_ABORT, str(results / JOB / "attempt-0"), home="/")
    assert read.returncode == 0 and json.loads(read.stdout) is None, read.stderr
    assert (results / JOB).stat().st_uid == ensure_user(USER).pw_uid
