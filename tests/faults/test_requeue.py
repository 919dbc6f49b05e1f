"""A job requeued with `scontrol requeue` on the lab: SLURM keeps its ID, and the second attempt's result is the one
that counts.

The real pipeline runs twice under one job ID (the real roles and a real model): attempt 0 to its end, then again
after `scontrol requeue` (SLURM sets SLURM_RESTART_COUNT=1 in the requeued attempt). The model's figure comes
from a file beside its script, which the running stage copies afresh for each attempt, so the two attempts print
different figures. Before attempt 1 the results dir is made to look its worst: attempt 0's ABORT marker planted.
"""

import json
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.faults import perf_rows
from tests.integration.submit.test_submit_lab import _cli, _job_output, _job_state
from tests.support.ansible import ROOT
from tests.support.lab.per_mode_jobs import both_modes_at_once
from tests.support.lab.pipeline import MODE_ENV

# lab_shared: the requeue touches this module's own jobs alone, and nothing here asserts a time bound (most of the
# time is SLURM's hold before a requeued job starts again): it runs beside the integration tests.
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared]

PROBE = """#!/bin/sh
# requeue_probe: the last rank prints the figure of the file beside this script (the test changes it per attempt);
# every rank fails without the job's secret, which each attempt must get.
. "$(dirname "$0")/common.sh"
if [ -z "$REQUEUE_TOKEN" ]; then echo "no secret in this attempt"; exit 3; fi
if [ "$NODE_RANK" -eq "$LAST_RANK" ]; then
  echo "performance: $(cat "$(dirname "$0")/figure") tokens/sec"
fi
"""
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")


def _zoo(base: Path) -> Path:
    zoo = base / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "scripts" / "dummy" / "run_requeue.sh").write_text(PROBE)
    cards = json.loads((zoo / "models.json").read_text())
    probe = dict(cards[0], name="requeue_probe", scripts="scripts/dummy/run_requeue.sh", tags=["requeue"])
    (zoo / "models.json").write_text(json.dumps(cards + [probe]))
    return zoo


def _wait_for_record(path: Path, job_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and _job_state(job_id) not in ACTIVE):
        assert time.monotonic() < deadline, f"no {path} within {timeout} s (job {job_id}: {_job_state(job_id)})"
        time.sleep(2)


@pytest.fixture(scope="module")
def requeued_job(lab_cluster, tmp_path_factory):
    """mode -> (results dir, job ID): a 3-node job run to its end, then requeued and run again with another
    figure; both modes' jobs side by side."""

    def run_in(mode):
        base = tmp_path_factory.mktemp(f"requeue-{mode}")
        zoo = _zoo(base)
        figure = zoo / "scripts" / "dummy" / "figure"
        figure.write_text("1111.5\n")
        results = base / "results"
        submitted = _cli(
            [
                "submit",
                "-N",
                "3",
                # Each mode's job at the same time, on the same nodes: the two hold different job IDs, ports and
                # results dirs, and most of each job's time is SLURM's wait before a requeued job starts again.
                "--no-exclusive",
                "--nodelist",
                "node[1-3]",
                "--tags",
                "requeue_probe",
                "--models-file",
                str(zoo / "models.json"),
                "--results-dir",
                str(results),
                "-c",
                json.dumps({"docker_env_vars": {"REQUEUE_TOKEN": "${MAD_SECRETS_REQUEUE}"}}),
                "--wait",
            ],
            base,
            extra_env={MODE_ENV: mode, "MAD_SECRETS_REQUEUE": f"requeue-{uuid.uuid4().hex}"},
            timeout=900,
        )
        assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
        job_id = submitted.stdout.split("Submitted job ")[1].split()[0]
        assert json.loads((results / "records" / f"{job_id}.json").read_text())["rows"][0]["performance"] == "1111.5"

        figure.write_text("2222.5\n")
        # The worst an earlier attempt can leave: its ABORT marker (before, preparation removed it; now it is the
        # earlier attempt's own and cannot stop the new one).
        (results / job_id / "attempt-0" / "ABORT").write_text('{"rank": 1, "node": "node2", "reason": "attempt 0"}')
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        assert requeue.returncode == 0, requeue.stderr
        _wait_for_record(results / "records" / job_id / "attempt-1.json", job_id)
        return results, job_id

    # Both at once even where make test runs each module's jobs one at a time (SLURM_MULTI_TEST_AT_ONCE=1): most of
    # each job's time is SLURM's hold before the requeued attempt starts, not CPU.
    return both_modes_at_once(run_in, output=lambda made: _job_output(made[0].parent, made[1]), at_once=2)


def test_the_requeued_attempt_runs_in_its_own_directory(requeued_job, pipeline_mode):
    results, job_id = requeued_job(pipeline_mode)
    assert sorted(p.name for p in (results / job_id).iterdir()) == ["attempt-0", "attempt-1"]
    log = (results / job_id / "attempt-1" / "nodes" / "node3" / "run.log").read_text()
    assert "performance: 2222.5 tokens/sec" in log
    assert not (results / job_id / "attempt-1" / "ABORT").exists()


def test_the_requeued_attempt_gets_the_jobs_secrets_which_outlive_its_collect_job(requeued_job, pipeline_mode):
    results, job_id = requeued_job(pipeline_mode)
    log = (results / job_id / "attempt-1" / "nodes" / "node2" / "run.log").read_text()
    assert "no secret in this attempt" not in log
    (secrets_file,) = (results.parent / "home").rglob("secrets.env")  # SLURM remembers the job: it may run again
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600


def test_the_jobs_record_is_the_second_attempts_and_names_both(requeued_job, pipeline_mode):
    results, job_id = requeued_job(pipeline_mode)
    record = json.loads((results / "records" / f"{job_id}.json").read_text())
    assert (record["attempt"], record["status"]) == (1, "SUCCESS"), record["reason"]
    assert [row["performance"] for row in record["rows"]] == ["2222.5"]
    assert [(a["attempt"], a["status"]) for a in record["attempts"]] == [(0, "SUCCESS"), (1, "SUCCESS")]
    first = json.loads((results / "records" / job_id / "attempt-0.json").read_text())
    assert [row["performance"] for row in first["rows"]] == ["1111.5"]


def test_perf_csv_carries_the_last_attempt_only(requeued_job, pipeline_mode):
    results, _ = requeued_job(pipeline_mode)
    assert [(row["model"], row["performance"], row["status"]) for row in perf_rows(results)] == [
        ("requeue_probe", "2222.5", "SUCCESS")
    ]


def test_collecting_the_requeued_job_again_changes_nothing(requeued_job, pipeline_mode):
    results, job_id = requeued_job(pipeline_mode)
    files = [
        results / "records" / f"{job_id}.json",
        results / "records" / job_id / "attempt-1.json",
        results / "perf.csv",
    ]
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]
    collected = _cli(["collect", job_id, "--results-dir", str(results)], results.parent, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == before
