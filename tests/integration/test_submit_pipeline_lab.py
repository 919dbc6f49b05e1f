"""`slurm-multi submit` with the real pipeline: a job cancelled or cut by its time limit mid-run still gets a
FAILURE record, and leaves no container on any node."""

import json
import subprocess
import time

import pytest

from tests.faults import job_containers
from tests.integration.test_submit_lab import _cli, _job_state, _wait_until_ended

pytestmark = pytest.mark.lab


def _submit_sleeper(tmp_path, *options):
    result = _cli(
        [
            "submit",
            "-N",
            "3",
            "--no-exclusive",
            "--tags",
            "dummy_sleep",
            "--results-dir",
            str(tmp_path / "results"),
            *options,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.split("Submitted job ")[1].split()[0]
    collect_id = result.stdout.split("its collect job: ")[1].split(")")[0]
    return job_id, collect_id


def _wait_for_models(tmp_path, job_id, timeout=240):
    attempt_dir = tmp_path / "results" / job_id / "attempt-0"
    logs = [attempt_dir / "nodes" / node / "run.log" for node in ("node1", "node2", "node3")]
    deadline = time.monotonic() + timeout
    while not all(log.exists() and "sleeping until stopped" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, f"the models of job {job_id} never all started"
        assert _job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), _job_state(job_id)
        time.sleep(1)


def _record(tmp_path, job_id):
    return json.loads((tmp_path / "results" / "records" / f"{job_id}.json").read_text())


def test_scancel_mid_run_leaves_a_failure_record_and_no_container(lab_cluster, tmp_path):
    job_id, collect_id = _submit_sleeper(tmp_path)
    _wait_for_models(tmp_path, job_id)
    subprocess.run(["scancel", job_id], check=True)
    assert _wait_until_ended(collect_id, timeout=240) == "COMPLETED"
    record = _record(tmp_path, job_id)
    assert record["status"] == "FAILURE"
    assert "cancel" in record["reason"].lower() or record.get("slurm_state") == "CANCELLED", record["reason"]
    # The hung model was snapshotted from inside before it was stopped, on every node.
    for node in ("node1", "node2", "node3"):
        diagnostics = (tmp_path / "results" / job_id / "attempt-0" / "nodes" / node / "diagnostics.txt").read_text()
        assert "== process table" in diagnostics and "run_sleep.sh" in diagnostics, diagnostics[:2000]
    assert job_containers(job_id) == []
    assert "FAILURE" in (tmp_path / "results" / "perf.csv").read_text()


def test_a_job_reaching_its_time_limit_leaves_a_failure_record_and_no_container(lab_cluster, tmp_path):
    job_id, collect_id = _submit_sleeper(tmp_path, "--time", "2")
    _wait_for_models(tmp_path, job_id)
    assert _wait_until_ended(collect_id, timeout=300) == "COMPLETED"
    record = _record(tmp_path, job_id)
    assert record["status"] == "FAILURE"
    assert any(word in record["reason"].lower() for word in ("time", "cancel", "stopped")), record["reason"]
    assert job_containers(job_id) == []
