"""A node that dies mid-run ends the run within its deadline, named in the record.

Push mode: node3's address drops every packet, as a dead host's does; the srun connection finds its step silent.
Pull mode has no connection to node3 (each node runs its own playbook), so node3 dies for real: its address
dropped, and its slurmd, its job step and all their processes and the job's containers SIGKILLed at once. Rank 0's
barrier then gives node3 up when its playbook heartbeat stands still (heartbeat_stale: 15 s here, default 30), and
the batch host ends the pull step, whose srun would otherwise wait for node3 until the job's time limit.

The window is kept under the lab's SlurmdTimeout (60 s): longer, and SLURM would mark node3 DOWN and kill other
engineers' jobs on it.

As root, an iptables that is missing or does not work is an error, not a skip: a skip would hide this fault's test
in CI. Only a non-root run (which has no lab either) skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from tests.faults import (
    address_dropped,
    assert_earlier_job_intact,
    job_containers,
    job_ids,
    node_killed,
    results_dir_with_baseline,
    run_job,
)
from tests.support.lab.per_mode_jobs import once_per_mode

pytestmark = [pytest.mark.lab, pytest.mark.fault]

NODE3_ADDRESS = "127.0.0.13"
PULL_HEARTBEAT_STALE = 15
# How long node3 stays dead at most; the run must have ended (failed) by then.
DEAD_WINDOW = 45


def iptables_problem() -> str | None:
    """Why iptables cannot fake a dead node here, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (`make lab-up` installs it with the lab's Debian packages)"
    listed = subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True, text=True)
    if listed.returncode != 0:
        return (
            f"`iptables -L INPUT -n` failed (exit {listed.returncode}): {listed.stderr.strip()[-500:]}; "
            "in a container, give it NET_ADMIN"
        )
    return None


@pytest.fixture(scope="module")
def working_iptables():
    """Skips without root; as root, fails the tests loudly when iptables cannot drop packets."""
    if os.geteuid() != 0:
        pytest.skip("faking a dead node needs root (iptables)")
    problem = iptables_problem()
    if problem:
        pytest.fail(f"cannot fake a dead node: {problem}")


@pytest.fixture(scope="module")
def dead_node_run(working_iptables, lab_cluster, tmp_path_factory):
    """mode -> (run, seconds from node3's death to the run's end, results dir, earlier job, earlier row)."""

    def run_in(mode):
        results_dir = tmp_path_factory.mktemp(f"dead-node-{mode}") / "results"
        earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
        cache_dir = tmp_path_factory.mktemp(f"dead-node-cache-{mode}")
        cache_dir.chmod(0o755)
        outcome = {}
        runner = threading.Thread(
            target=lambda: outcome.update(
                run=run_job(
                    results_dir,
                    # node3 must be in the job: SLURM may pick node4.. of a grown lab over busy node1-3.
                    nodelist="node[1-3]",
                    model_tags=["dummy"],
                    image_cache_dir=str(cache_dir),
                    **({"heartbeat_stale": PULL_HEARTBEAT_STALE} if mode == "pull" else {}),
                )
            )
        )
        runner.start()
        # Rank 0 has published the image: the workers are about to load it and meet at the barrier.
        deadline = time.monotonic() + 300
        while not list(cache_dir.glob("*.json")) and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        (job_id,) = job_ids(results_dir) - {earlier_job}
        with address_dropped(NODE3_ADDRESS) if mode == "push" else node_killed("node3", job_id):
            died_at = time.monotonic()
            runner.join(DEAD_WINDOW)
            seconds_dead = time.monotonic() - died_at
        runner.join()
        return outcome["run"], seconds_dead, results_dir, earlier_job, earlier_row

    return once_per_mode(run_in, output=lambda made: made[0].output)


def test_a_dead_node_ends_the_run_within_its_deadline(dead_node_run, pipeline_mode):
    run, seconds_dead, *_ = dead_node_run(pipeline_mode)
    assert seconds_dead < DEAD_WINDOW, f"the run was still going {seconds_dead:.0f}s after node3 died"
    assert run.rc != 0, run.output[-3000:]


def test_a_dead_node_is_named_in_the_failure_record(dead_node_run, pipeline_mode):
    run, *_ = dead_node_run(pipeline_mode)
    assert run.record["status"] == "FAILURE"
    assert "node3" in run.record["reason"], run.record["reason"]
    if pipeline_mode == "pull":  # the batch host ended the step, whose srun waited for node3
        assert "slurm-multi: lost node3 stopped its heartbeat" in run.output, run.output[-3000:]


def test_a_dead_node_leaves_no_container_and_keeps_the_earlier_job(dead_node_run, pipeline_mode):
    run, _, results_dir, earlier_job, earlier_row = dead_node_run(pipeline_mode)
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(results_dir, earlier_job, earlier_row)
