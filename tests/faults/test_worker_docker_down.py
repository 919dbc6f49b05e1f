"""A worker's Docker daemon is down before the run: the job fails at once, naming the node and Docker."""

import pytest

from tests.faults import (
    FAULT_RUN_BOUND,
    NODELIST,
    assert_earlier_job_intact,
    job_containers,
    lab_daemon_stopped,
    results_dir_with_baseline,
    run_job,
)
from tests.support.lab.per_mode_jobs import MODES, in_mode, side_by_side

pytestmark = [pytest.mark.lab, pytest.mark.fault]


@pytest.fixture(scope="module")
def docker_down_runs(lab_cluster, tmp_path_factory):
    """mode -> (run with node3's dockerd stopped, results dir, earlier job ID, earlier perf row): both modes' runs
    side by side, in one window with the daemon down (each fails within seconds; their bound is FAULT_RUN_BOUND)."""
    scratch = tmp_path_factory.getbasetemp()
    prepared = {}
    for mode in MODES:
        results_dir = tmp_path_factory.mktemp(f"docker-down-{mode}") / "results"
        prepared[mode] = (results_dir, *results_dir_with_baseline(scratch, results_dir))
    # The preflight stage's docker check off (tests/faults/test_preflight_faults.py has it on): the preparation stage
    # must still catch the dead daemon by itself.
    checks = ["disk", "shared_dir", "scratch", "gpus", "stale_gpu_containers", "clock"]

    def run(mode):
        # node3 must be in the job: SLURM may pick node4.. of a grown lab over busy node1-3.
        return run_job(prepared[mode][0], mode=mode, nodelist=NODELIST, model_tags=["dummy"], preflight_checks=checks)

    with lab_daemon_stopped("node3", "dockerd"):
        runs = side_by_side({mode: (lambda mode=mode: run(mode)) for mode in MODES})
    return {mode: (runs[mode], *prepared[mode]) for mode in MODES}


@pytest.fixture
def docker_down_run(docker_down_runs):
    """mode -> that mode's (run, results dir, earlier job ID, earlier perf row)."""
    return lambda mode: in_mode(docker_down_runs[mode], mode, docker_down_runs[mode][0].output)


def test_the_run_fails_in_bounded_time(docker_down_run, pipeline_mode):
    run, *_ = docker_down_run(pipeline_mode)
    assert run.rc != 0, run.output[-3000:]
    assert run.seconds < FAULT_RUN_BOUND


def test_the_failure_record_names_node3_and_docker(docker_down_run, pipeline_mode):
    run, *_ = docker_down_run(pipeline_mode)
    record = run.record
    assert record["status"] == "FAILURE"
    assert "node3" in record["reason"] and "Docker" in record["reason"], record["reason"]


def test_the_node_status_says_docker_is_not_reachable(docker_down_run, pipeline_mode):
    run, *_ = docker_down_run(pipeline_mode)
    status = run.status("node3")
    assert (status["status"], status["stage"]) == ("FAILURE", "preparation"), status
    assert "Docker on node3 is not reachable" in status["reason"], status


def test_the_earlier_job_keeps_its_record_and_row(docker_down_run, pipeline_mode):
    _, results_dir, earlier_job, earlier_row = docker_down_run(pipeline_mode)
    assert_earlier_job_intact(results_dir, earlier_job, earlier_row)


def test_no_container_of_the_job_is_left(docker_down_run, pipeline_mode):
    run, *_ = docker_down_run(pipeline_mode)
    assert job_containers(run.job_id) == []


def test_a_rerun_after_docker_is_back_succeeds(docker_down_run, pipeline_mode):
    _, results_dir, earlier_job, earlier_row = docker_down_run(pipeline_mode)
    rerun = run_job(results_dir, model_tags=["dummy"])
    assert rerun.rc == 0, rerun.output[-3000:]
    assert rerun.record["status"] == "SUCCESS"
    assert_earlier_job_intact(results_dir, earlier_job, earlier_row)
