"""The fixed cost of a warm 3-node job in the default mode stays small, on the lab.

The job's overhead is what benchmarks/e2e_bench.py measures: SLURM's StartTime to EndTime (whole seconds) minus the
longest container (each node's status.json, the model's start to its exit). Its figure, side by side with a plain
sbatch script, is the benchmark's (docs/figures.md); this is a guard with room for a loaded machine: 6 s."""

import json

import pytest

from benchmarks.e2e_bench import container_seconds, job_elapsed
from tests.integration.submit.test_submit_lab import _cli

# Alone on the machine (lab_alone: tests/run_suite.sh runs it first, with nothing beside it): a time guard measured
# beside other work measures that work too (the fresh-clone run beside the no-lab tests: 6.8 and 7.0 s).
pytestmark = [pytest.mark.lab, pytest.mark.lab_alone, pytest.mark.mode_independent]

NODES = ("node1", "node2", "node3")
OVERHEAD_GUARD_SECONDS = 6.0


def _submit_push(tmp_path, results):
    ran = _cli(
        ["submit", "-N", "3", "--nodelist", "node[1-3]", "--no-exclusive", "--mode", "push"]
        + ["--tags", "dummy_lastrank", "--results-dir", str(results), "--wait"],
        tmp_path,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return ran.stdout.split("Submitted job ")[1].split()[0]


def _overhead(job: str, attempt) -> float:
    statuses = [json.loads((attempt / "nodes" / node / "status.json").read_text()) for node in NODES]
    return job_elapsed(job) - container_seconds((s["started_at"], s["ended_at"]) for s in statuses)


@pytest.fixture(scope="module")
def warm_jobs(lab_cluster, tmp_path_factory):
    """[(job ID, attempt dir)] of three push-mode jobs after a first one put the image on every node."""
    work = tmp_path_factory.mktemp("fixed-cost")
    _submit_push(work, work / "warm-up")
    jobs = []
    for run in ("first", "second", "third"):
        job = _submit_push(work, work / run)
        jobs.append((job, work / run / job / "attempt-0"))
    return jobs


def test_a_warm_3_node_jobs_overhead_is_within_the_guard(warm_jobs):
    # The best of three: SLURM's times are whole seconds (each job's figure is up to a second off either way), and one
    # job can meet a burst of other work (the fresh-clone CI run measured 6.03 and 6.93 s for the better of two).
    overheads = {job: _overhead(job, attempt) for job, attempt in warm_jobs}
    assert min(overheads.values()) <= OVERHEAD_GUARD_SECONDS, f"overheads: {overheads}"


def test_the_barrier_is_met_in_the_run_module_right_before_the_container(warm_jobs):
    _, attempt = warm_jobs[0]
    for node in NODES:
        steps = json.loads((attempt / "nodes" / node / "status.json").read_text())["steps"]
        # The barrier is the run module's first step now, timed in the same status as the container.
        assert steps["barrier"]["end"] <= steps["container_start"]["start"], (node, steps)
    record = json.loads((attempt.parent.parent / "records" / f"{attempt.parent.name}.json").read_text())
    assert record["status"] == "SUCCESS"
    assert set(record["barrier_wait"]) == set(NODES)
