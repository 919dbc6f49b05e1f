"""A results dir shared by a team: a second, real user collects into it (useradd, then the process drops to its uid).

The team's dir is root's, group-writable, setgid and sticky (`chgrp TEAM DIR && chmod 3775 DIR`); root collected a
job there first, leaving `perf.csv.lock` 0644 as earlier versions created it. The teammate's collect must work (flock
needs no write access: the lock is opened read-only; perf.csv, root's, is the team's file, rewritten in place) and
record its own job; a job dir the teammate owns is refused to root's collect, as any dir another user owns.
"""

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.unit.library.test_collect_results_module import _DIRECT_RUN, ROOT

pytestmark = pytest.mark.fault

PEER = "slurmmulti-peer"
TEAM = "slurmmulti-team"


def _ensure_peer():
    if os.geteuid() != 0:
        pytest.skip("creating a second user needs root")
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd (Debian's passwd)")
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True)
    try:
        pwd.getpwnam(PEER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                "--groups",
                TEAM,
                PEER,
            ],
            check=True,
        )
    return pwd.getpwnam(PEER), grp.getgrnam(TEAM)


def _write_job(results: Path, job_id: str, figure: str, owner=None):
    node_dir = results / job_id / "attempt-0" / "nodes" / "node1"
    node_dir.mkdir(parents=True)
    (node_dir / "status.json").write_text(
        json.dumps({"node": "node1", "rank": 0, "status": "SUCCESS", "exit_code": 0, "perf_lines": 1, "reason": ""})
    )
    (node_dir / "run.log").write_text(f"performance: {figure} tok/s\n")
    if owner:
        for path in [results / job_id, *(results / job_id).rglob("*")]:
            os.chown(path, owner.pw_uid, owner.pw_gid)


# The venv's interpreter lives under /root (0700 here), which the teammate cannot reach: the process starts as
# root, loads the module's libraries, then becomes the teammate (uid, gid, groups) before it touches any file.
_AS_USER = (
    "import os, sys, pwd, runpy; sys.path.insert(0, {root!r} + '/collections'); "
    "import pandas, ansible.module_utils.basic; "
    "import ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection; "
    "user = pwd.getpwnam(sys.argv.pop(1)); os.initgroups(user.pw_name, user.pw_gid); os.setgid(user.pw_gid); "
    "os.setuid(user.pw_uid); runpy.run_path({module!r}, run_name='__main__')"
).format(root=str(ROOT), module=str(ROOT / "library" / "collect_results.py"))


def _collect(results: Path, job_id: str, user=None):
    """The collect_results module's real code, as `user` (None: root); (exit code, result)."""
    args = json.dumps(
        {
            "ANSIBLE_MODULE_ARGS": {
                "results_dir": str(results),
                "job_id": job_id,
                "nodes": ["node1"],
                "model": {"name": f"m{job_id}"},
            }
        }
    )
    argv = [sys.executable, "-c", _AS_USER, user, args] if user else [sys.executable, "-c", _DIRECT_RUN, args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def team_dir():
    peer, team = _ensure_peer()
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-team-"))
    base.chmod(0o755)  # mkdtemp makes it 0700: the teammate must reach the results dir inside
    results = base / "results"
    results.mkdir()
    os.chown(results, 0, team.gr_gid)
    results.chmod(0o3775)
    _write_job(results, "5001", "1000")
    rc, result = _collect(results, "5001")
    assert rc == 0 and result["status"] == "SUCCESS", result
    (results / "perf.csv.lock").chmod(0o644)  # as versions before 0664 created it
    yield results, peer
    shutil.rmtree(base)


def test_a_teammate_collects_into_the_shared_results_dir_with_a_lock_file_it_cannot_write(team_dir):
    results, peer = team_dir
    _write_job(results, "5002", "2000", owner=peer)
    rc, result = _collect(results, "5002", user=PEER)
    assert rc == 0, result.get("msg")
    assert result["status"] == "SUCCESS"
    assert (results / "records" / "5002.json").stat().st_uid == peer.pw_uid
    perf = (results / "perf.csv").read_text()
    assert "m5001" in perf and "m5002" in perf and "2000" in perf


def test_a_lock_file_the_teammate_cannot_read_is_a_clear_error_naming_the_file_and_the_fix(team_dir):
    results, peer = team_dir
    _write_job(results, "5003", "3000", owner=peer)
    (results / "perf.csv.lock").chmod(0o600)
    rc, result = _collect(results, "5003", user=PEER)
    assert rc != 0
    assert str(results / "perf.csv.lock") in result["msg"] and "chmod 0664" in result["msg"]
    assert "Traceback" not in result["msg"] and not (results / "records" / "5003.json").exists()


def test_a_job_dir_the_teammate_owns_is_refused_to_anothers_collect(team_dir):
    results, peer = team_dir
    _write_job(results, "5004", "4000", owner=peer)
    rc, result = _collect(results, "5004")
    assert rc != 0
    assert f"is owned by {PEER} (uid {peer.pw_uid}), not by you" in result["msg"]
