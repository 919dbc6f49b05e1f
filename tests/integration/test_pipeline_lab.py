"""The whole pipeline on the 3-node lab cluster: real ansible-playbook, srun, docker save/load, TCP, containers.

Each model runs once per mode, every run side by side with the others (each in a results dir of its own, on
node1-3); the bound on how fast a crash stops the healthy ranks holds under that load.
"""

import csv
import json
import subprocess

import pytest

from tests.faults import job_containers
from tests.support.lab.per_mode_jobs import MODES, in_mode, side_by_side
from tests.support.lab.pipeline import run_pipeline, run_pipelines_in_one_allocation

pytestmark = pytest.mark.lab

NODES = ("node1", "node2", "node3")
# dummy_multiple_results runs in test_sweep_lab's succeeding sweeps, which check its rows.
MODELS = ("dummy_lastrank", "dummy_fail", "dummy_nometric")


@pytest.fixture(scope="module")
def model_runs(lab_cluster, tmp_path_factory):
    """(model, mode) -> its run."""

    def run(model, mode):
        results = tmp_path_factory.mktemp(f"pipeline-{model}-{mode}") / "results"
        return run_pipeline(results, mode=mode, nodelist="node[1-3]", model_tags=[model])

    def run_twice():
        # The README's way inside one salloc, twice: a passing model, then a failing one (push mode: the pull
        # step's job script names its run the same way, from its own nonce).
        results = tmp_path_factory.mktemp("pipeline-twice") / "results"
        return results, run_pipelines_in_one_allocation(
            results, [{"model_tags": ["dummy_lastrank"]}, {"model_tags": ["dummy_fail"]}]
        )

    every = {(model, mode): (lambda key=(model, mode): run(*key)) for model in MODELS for mode in MODES}
    return side_by_side(dict(every, twice=run_twice))


def _run_of(model_runs, model, mode):
    return in_mode(model_runs[model, mode], mode, model_runs[model, mode].output)


def _perf_rows(run) -> list:
    with open(run.results_dir / "perf.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_last_rank_metric_on_a_worker_makes_a_success_row(model_runs, pipeline_mode):
    run = _run_of(model_runs, "dummy_lastrank", pipeline_mode)
    assert run.rc == 0, run.output[-3000:]
    rows = _perf_rows(run)
    assert [(r["model"], r["performance"], r["metric"], r["status"], r["nnodes"]) for r in rows] == [
        ("dummy_lastrank", "1.0123e+04", "tokens/sec", "SUCCESS", "3")
    ]
    assert "performance: 1.0123e+04 tokens/sec" in (run.attempt_dir / "nodes" / "node3" / "run.log").read_text()
    assert "performance:" not in (run.attempt_dir / "nodes" / "node1" / "run.log").read_text()
    assert "rank 2/3 on node3, master 127.0.0.11" in (run.attempt_dir / "nodes" / "node3" / "run.log").read_text()
    assert job_containers(run.job_dir.name) == []


def test_a_healthy_job_records_every_node_ok_in_its_preflight(model_runs, pipeline_mode):
    run = _run_of(model_runs, "dummy_lastrank", pipeline_mode)
    assert run.record["preflight"] == {"node1": [], "node2": [], "node3": []}
    assert "preflight" in run.record["timeline"]["node2"]


def test_every_node_runs_the_image_id_the_barrier_checked_never_a_tag(model_runs, pipeline_mode):
    run = _run_of(model_runs, "dummy_lastrank", pipeline_mode)
    (image_id,) = {run.status(node)["image_id"] for node in NODES}
    assert image_id.startswith("sha256:")
    record = json.loads((run.results_dir / "records" / f"{run.job_dir.name}.json").read_text())
    assert [record["per_node"][node]["image_id"] for node in NODES] == [image_id] * 3
    # What each `docker run` was given, as its daemon recorded the container's creation.
    started = int(min(run.status(node)["started_at"] for node in NODES)) - 5
    created = subprocess.run(
        ["srun", "-N3", "-w", "node[1-3]", "--quiet", "docker", "events", "--since", str(started), "--until", "0s"]
        + ["--filter", "event=create", "--filter", f"label=slurm-multi.job={run.job_dir.name}"]
        + ["--format", "{{.Actor.Attributes.image}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert created == [image_id] * 3


def test_a_failing_rank_stops_the_others_and_leaves_diagnostics(model_runs, pipeline_mode):
    run = _run_of(model_runs, "dummy_fail", pipeline_mode)
    assert run.rc != 0
    failed = run.status("node2")
    assert (failed["status"], failed["exit_code"]) == ("FAILURE", 3)
    for node in ("node1", "node3"):
        status = run.status(node)
        assert status["aborted_by_rank"] == 1, status
        # The healthy ranks' models sleep for 600 s; fail-fast stops them within seconds of rank 1's crash.
        assert status["ended_at"] - status["started_at"] < 60, status
    diagnostics = (run.attempt_dir / "nodes" / "node2" / "diagnostics.txt").read_text()
    assert "ExitCode" in diagnostics or "exit code" in diagnostics.lower()
    assert "simulated NCCL failure" in diagnostics
    rows = _perf_rows(run)
    assert [(r["model"], r["status"]) for r in rows] == [("dummy_fail", "FAILURE")]
    assert "node2" in run.record["reason"]
    assert job_containers(run.job_dir.name) == []


def test_a_model_that_prints_no_metric_gets_a_failure_row_saying_so(model_runs, pipeline_mode):
    run = _run_of(model_runs, "dummy_nometric", pipeline_mode)
    assert run.rc != 0
    assert [(r["model"], r["status"]) for r in _perf_rows(run)] == [("dummy_nometric", "FAILURE")]
    assert "no performance metric" in run.record["reason"]


@pytest.mark.mode_independent
def test_a_second_run_in_one_allocation_is_a_new_run_with_its_own_record_and_exit_code(model_runs):
    results, (output, codes) = model_runs["twice"]
    assert codes[0] == 0 and codes[1] != 0, output[-3000:]  # the failing second run fails, whatever came before
    job_ids = sorted(path.name for path in results.iterdir() if path.is_dir() and path.name != "records")
    assert len(job_ids) == 2 and job_ids[1] == f"{job_ids[0]}.run2", job_ids
    assert f"this run is job {job_ids[1]}, with its own results dir" in " ".join(output.split())  # lines folded
    records = {job: json.loads((results / "records" / f"{job}.json").read_text()) for job in job_ids}
    assert [(records[job]["status"], records[job]["rows"][0]["model"]) for job in job_ids] == [
        ("SUCCESS", "dummy_lastrank"),
        ("FAILURE", "dummy_fail"),
    ]
    nonces = {json.loads((results / job / "attempt-0" / "run.json").read_text())["nonce"] for job in job_ids}
    assert len(nonces) == 2
    with open(results / "perf.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["model"], row["status"]) for row in rows] == [
        ("dummy_lastrank", "SUCCESS"),
        ("dummy_fail", "FAILURE"),
    ]
