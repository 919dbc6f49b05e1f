"""`slurm-multi submit` with the real pipeline: a job cancelled or cut by its time limit mid-run still gets a
FAILURE record, and leaves no container on any node.

The four jobs (each fault in each mode) share node1-3 (`--no-exclusive`): each fault's two modes are submitted
together, the next pair once their models sleep. The models only sleep, and nothing here asserts a time bound that
another job's load could stretch, so the jobs wait out their cancel and time limit side by side, where one after
another took about 5 minutes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.faults import job_containers
from tests.integration.submit.test_submit_lab import _cli, _cli_env, _job_output, _job_state, _wait_until_ended
from tests.support.lab.per_mode_jobs import MODES, mode_shown
from tests.support.lab.pipeline import MODE_ENV

pytestmark = pytest.mark.lab

# The time-limit jobs' models ignore TERM, so each node's run module takes `docker stop`'s grace to stop its container:
# the early warning's stop must wait for it on every node, not end the pipeline (and srun's steps with it) at once.
SLOW_TO_STOP = ("-c", '{"docker_env_vars": {"SLEEP_IGNORES_TERM": "1"}}')
FAULTS = {"scancel": (), "time_limit": ("--time", "2", *SLOW_TO_STOP)}


def _submit_sleeper(tmp_path, mode, *options):
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
        extra_env={MODE_ENV: mode},
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


@pytest.fixture(scope="module")
def stopped_jobs(lab_cluster, tmp_path_factory):
    """{(fault, mode): (base dir, job ID)}: every job submitted at once, its models started, the scancel jobs
    cancelled, and every collect job ended."""
    jobs = {}
    try:
        for fault, options in FAULTS.items():
            # A fault's two modes at a time: the next pair starts once these models sleep (two pipelines starting
            # at once fill the machine; four made the preflight's clock check take the delay for skew).
            for mode in MODES:
                base = tmp_path_factory.mktemp(f"{fault}-{mode}")
                jobs[fault, mode] = (base, *_submit_sleeper(base, mode, *options))
            for mode in MODES:
                _wait_for_models(*jobs[fault, mode][:2])
    except BaseException:
        # A sleeper left behind sleeps until its time limit, under every later test of the run (one did, 28 min).
        subprocess.run(["scancel", *(job_id for _, job_id, _ in jobs.values())], check=False)
        raise
    for fault, mode in jobs:
        if fault == "scancel":
            subprocess.run(["scancel", jobs[fault, mode][1]], check=True)
    for _, job_id, collect_id in jobs.values():
        assert _wait_until_ended(collect_id, timeout=300) == "COMPLETED", job_id
    return {key: (base, job_id) for key, (base, job_id, _) in jobs.items()}


def _stopped(stopped_jobs, fault, mode):
    base, job_id = stopped_jobs[fault, mode]
    output = _job_output(base, job_id)
    assert mode_shown(output) == mode, f"the {mode} test would read a job run in another mode: {output[-3000:]}"
    return base, job_id


def test_scancel_mid_run_leaves_a_failure_record_and_no_container(stopped_jobs, pipeline_mode):
    tmp_path, job_id = _stopped(stopped_jobs, "scancel", pipeline_mode)
    record = _record(tmp_path, job_id)
    assert record["status"] == "FAILURE"
    assert "cancel" in record["reason"].lower() or record.get("slurm_state") == "CANCELLED", record["reason"]
    # The hung model was snapshotted from inside before it was stopped, on every node.
    for node in ("node1", "node2", "node3"):
        diagnostics = (tmp_path / "results" / job_id / "attempt-0" / "nodes" / node / "diagnostics.txt").read_text()
        assert "== process table" in diagnostics and "run_sleep.sh" in diagnostics, diagnostics[:2000]
    assert job_containers(job_id) == []
    assert "FAILURE" in (tmp_path / "results" / "perf.csv").read_text()


def test_a_job_reaching_its_time_limit_leaves_a_failure_record_and_no_container(stopped_jobs, pipeline_mode):
    tmp_path, job_id = _stopped(stopped_jobs, "time_limit", pipeline_mode)
    record = _record(tmp_path, job_id)
    assert record["status"] == "FAILURE"
    assert any(word in record["reason"].lower() for word in ("time", "cancel", "stopped")), record["reason"]
    # Every node's run module waited out `docker stop`'s grace (137: SIGKILLed) and wrote its status before the end.
    for node in ("node1", "node2", "node3"):
        status = json.loads((tmp_path / "results" / job_id / "attempt-0" / "nodes" / node / "status.json").read_text())
        assert (status["status"], status["exit_code"]) == ("FAILURE", 137), status
    assert job_containers(job_id) == []


# `slurm-multi run` inside salloc, stopped by a TERM (the user's kill, or the end of the allocation): it stops the
# pipeline as the job script does (slurm_multi/pipeline_stop.py). Push mode only: a pull-mode run stops through its
# one step, which ends by itself once every node's pull_node.py has stopped its playbook.
@pytest.mark.mode_independent
def test_a_stopped_slurm_multi_run_records_every_node_and_leaves_no_container(lab_cluster, tmp_path):
    results, pid_file = tmp_path / "results", tmp_path / "run.pid"
    command = (
        f'echo $$ > "{pid_file}"; exec "{sys.executable}" -m slurm_multi.cli run --mode push --tags dummy_sleep '
        f"-c '{SLOW_TO_STOP[1]}' --results-dir \"{results}\""
    )
    run = subprocess.Popen(
        ["salloc", "-N", "3", "-w", "node[1-3]", "--quiet", "sh", "-c", command],
        cwd=tmp_path,
        env=_cli_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len([log for log in results.glob("*/attempt-0/nodes/*/run.log") if "sleeping" in log.read_text()]) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "the models never all started"
            time.sleep(1)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        output = run.communicate(timeout=180)[0]
    finally:
        if run.poll() is None:
            run.kill()
    (job_dir,) = [path for path in results.iterdir() if path.is_dir() and path.name != "records"]
    for node in ("node1", "node2", "node3"):
        status = json.loads((job_dir / "attempt-0" / "nodes" / node / "status.json").read_text())
        assert (status["status"], status["exit_code"]) == ("FAILURE", 137), output[-3000:]
    assert job_containers(job_dir.name) == []
    assert "FAILURE" in output
