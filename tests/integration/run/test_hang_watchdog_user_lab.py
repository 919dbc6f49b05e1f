"""The hang watchdog of a job an ordinary user submits, on the lab: a rank reading a slow disk is not hung.

The job's user (tests.support.users.local_users.USER, in the docker group) submits from a venv of its own
(tests.support.users.user_venv) with `slurm-multi submit --wait`, so every node-side step runs as that user, who may not
read /proc/<pid>/io of the container's processes (root's). tests/fixtures/slow_reads_zoo's model on 2 nodes, with
hang_timeout at 10 s: rank 1 reads a 30 MB shard from a disk its container may read at 1 MB/s (docker run's
--device-read-bps), printing nothing and using no CPU, while rank 0 waits; then both wait on nothing. One job shows
both: no hang while the reads advance, a hang once nothing does.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from slurm_multi.lab.cluster import LabNode
from tests.support.lab.slow_disk import throttled_read_options
from tests.support.users.local_users import TEAM, USER, ensure_user, run_as
from tests.support.users.user_venv import ensure_user_venv

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2")
ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "slow_reads_zoo"
HANG_TIMEOUT = 10


class UserJob:
    def __init__(self, run, results: Path):
        self.run = run
        self.results = results

    @property
    def attempt_dir(self) -> Path:
        (job,) = [path for path in self.results.iterdir() if path.is_dir() and path.name.isdigit()]
        return job / "attempt-0"

    @property
    def record(self) -> dict:
        return json.loads((self.results / "records" / f"{self.attempt_dir.parent.name}.json").read_text())

    def status(self, node: str) -> dict:
        return json.loads((self.attempt_dir / "nodes" / node / "status.json").read_text())

    def written_at(self, node: str, text: str) -> float:
        """When the node's log line holding ``text`` was written (run.log.times: `<offset> <epoch>` marks)."""
        log = (self.attempt_dir / "nodes" / node / "run.log").read_bytes()
        marks = (self.attempt_dir / "nodes" / node / "run.log.times").read_text().split()
        offset = log.index(text.encode())
        return max(float(at) for start, at in zip(marks[::2], marks[1::2], strict=True) if int(start) <= offset)


@pytest.fixture(scope="module")
def slow_reads_job(lab_cluster):
    user = ensure_user(USER, groups=(TEAM, "docker"))
    venv = ensure_user_venv()
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-user-job-"))
    place.chmod(0o755)
    results = place / "results"
    results.mkdir()
    os.chown(results, user.pw_uid, user.pw_gid)
    shutil.copytree(ZOO, place / "zoo")
    for path in (place / "zoo").rglob("*"):
        path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    throttle = throttled_read_options(str(LabNode(2).dir / "docker"))
    run = run_as(
        USER,
        [
            str(venv / "bin" / "slurm-multi"),
            "submit",
            "-N",
            str(len(NODES)),
            "--nodelist",
            "node[1-2]",
            "--no-exclusive",
            "--tags",
            "slow_reads",
            "--models-file",
            str(place / "zoo" / "models.json"),
            "--results-dir",
            str(results),
            "-e",
            f"hang_timeout={HANG_TIMEOUT}",
            "-e",
            json.dumps({"additional_docker_run_options": throttle}),
            "--wait",
        ],
        cwd=place,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "LANG": "C.UTF-8"},
        timeout=600,
    )
    yield UserJob(run, results)
    collect_job = re.search(r"its collect job: (\d+)", run.stdout)
    if collect_job:
        _wait_until_gone(collect_job.group(1))
    shutil.rmtree(place)


def _wait_until_gone(job_id: str) -> None:
    """Until the job left SLURM's queue: the collect job writes into the results dir after `--wait` returned."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        if not queued.stdout.strip():
            return
        time.sleep(1)


def test_a_rank_reading_a_slow_disk_is_not_called_hung_while_it_reads(slow_reads_job):
    job = slow_reads_job
    log = (job.attempt_dir / "nodes" / "node2" / "run.log").read_text()
    assert "rank 1 read its shard" in log, (log, job.run.stdout[-3000:], job.run.stderr[-3000:])
    started, ended = job.written_at("node2", "rank 1 reads its shard"), job.written_at("node2", "rank 1 read its shard")
    assert ended - started > HANG_TIMEOUT  # it sat still past the timeout, in reads that advanced
    # The hang came only once nothing advanced: a timeout after the reads ended.
    assert job.status("node1")["ended_at"] - ended >= HANG_TIMEOUT


def test_ranks_with_nothing_advancing_are_called_hung(slow_reads_job):
    job = slow_reads_job
    assert job.record["status"] == "FAILURE", job.run.stdout[-3000:]
    assert job.record["reason"].startswith("hang"), job.record["reason"]
    ended = job.written_at("node2", "rank 1 read its shard")
    for node in NODES:
        status = job.status(node)
        assert status["hang"] is True and status["reason"] == f"hang: no rank made progress for {HANG_TIMEOUT} s"
        assert status["ended_at"] - ended <= HANG_TIMEOUT + 30, (node, status["ended_at"] - ended)
