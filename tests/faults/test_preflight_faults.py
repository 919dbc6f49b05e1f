"""The preflight stage on the lab: a bad node fails the job in seconds, before any build, naming the node and the
problem; the record's preflight section lists every node (both modes, like every lab test)."""

import contextlib
import subprocess

import pytest

from slurm_multi.lab import cluster as lab
from tests.faults import lab_daemon_stopped, run_job

pytestmark = [pytest.mark.lab, pytest.mark.fault]
# Preflight answers before any build: the job ends well under a healthy run's minute (pull mode's nodes also wait
# preflight_exchange_wait, 20 s, for a node that never reports).
PREFLIGHT_FAILURE_BOUND = 75
# The node broken must be in the job: SLURM may otherwise pick node4 (when the lab has grown) over a busy node.
NODELIST = "node[1-3]"


@contextlib.contextmanager
def private_dir_on(node: str, path: str):
    """Mount a private tmpfs over ``path`` inside ``node``'s mount namespace only (its slurmd's): that node no
    longer sees the shared directory there. Unmounted afterwards, whatever happened."""
    pid = lab.running_pid(f"{node}-slurmd", "slurmd")
    assert pid is not None, f"{node}'s slurmd is not running: the lab is not up"
    enter = ["nsenter", "-t", str(pid), "-m"]
    subprocess.run([*enter, "mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", path], check=True)
    try:
        yield
    finally:
        subprocess.run([*enter, "umount", path], check=True)


def _assert_no_build(run):
    assert not (run.attempt_dir / "build_manifest.json").exists(), "the build stage ran"
    for node, steps in run.record["timeline"].items():
        assert "build" not in (steps or {}) and "load" not in (steps or {}), (node, steps)


# Function-scoped: each mode (the autouse pipeline_mode fixture) runs its own job.
@pytest.fixture
def docker_down_run(lab_cluster, tmp_path):
    results_dir = tmp_path / "results"
    with lab_daemon_stopped("node3", "dockerd"):
        return run_job(results_dir, nodelist=NODELIST, model_tags=["dummy"])


def test_docker_down_fails_in_preflight_naming_node3(docker_down_run):
    run = docker_down_run
    assert run.rc != 0, run.output[-3000:]
    assert run.seconds < PREFLIGHT_FAILURE_BOUND, run.seconds
    record = run.record
    assert record["status"] == "FAILURE"
    assert "node3" in record["reason"] and "Docker daemon not answering" in record["reason"], record["reason"]
    assert record["preflight"]["node1"] == [] and record["preflight"]["node2"] == [], record["preflight"]
    [found] = record["preflight"]["node3"]
    assert found["check"] == "docker" and "start dockerd on node3" in found["fix"], found
    assert run.status("node3")["stage"] == "preflight"
    _assert_no_build(run)


@pytest.fixture
def private_results_run(lab_cluster, tmp_path):
    results_dir = tmp_path / "results"
    results_dir.mkdir(mode=0o755)
    # Pull mode waits out preflight_exchange_wait twice here (node2 for rank 0's nonce, which it cannot see; the
    # others for node2's result, which they cannot see): 10 s instead of the default 20 s still leaves the healthy
    # nodes, started by one srun step, ample time to see each other, and saves the test some 20 s.
    with private_dir_on("node2", str(results_dir)):
        return run_job(results_dir, nodelist=NODELIST, model_tags=["dummy"], preflight_exchange_wait=10)


def test_a_results_dir_node2_does_not_share_fails_naming_node2_and_the_path(private_results_run):
    run = private_results_run
    assert run.rc != 0, run.output[-3000:]
    assert run.seconds < PREFLIGHT_FAILURE_BOUND, run.seconds
    record = run.record
    assert record["status"] == "FAILURE"
    assert "node2" in record["reason"] and str(run.results_dir) in record["reason"], record["reason"]
    [found] = record["preflight"]["node2"]
    assert found["check"] == "shared_dir" and str(run.results_dir) in found["problem"], found
    assert record["preflight"]["node1"] == [] and record["preflight"]["node3"] == [], record["preflight"]
    # The healthy nodes only stopped for node2 (in pull mode they learn of it by its missing result).
    assert not record["per_node"]["node1"]["root_cause"] and not record["per_node"]["node3"]["root_cause"], record
    _assert_no_build(run)


# A healthy job's preflight section (every node ok): tests/integration/test_pipeline_lab.py reads it from its
# dummy_lastrank job, in both modes.
