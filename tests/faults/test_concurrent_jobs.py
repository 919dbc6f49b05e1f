"""Two jobs on the same nodes at once, a run outside SLURM beside a job, and collecting jobs twice or at the same
moment into one results dir."""

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from tests.faults import (
    NODES,
    assert_earlier_job_intact,
    job_containers,
    job_ids,
    perf_rows,
    results_dir_with_baseline,
    run_job,
)
from tests.support.ansible import ROOT, ansible_env, run_ansible
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.per_mode_jobs import once_per_mode

# Its own jobs, results dirs and no time bound: it may share the lab with another module's jobs (make test's
# serial lab run was the long pole by more than this module's 73 s).
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared]


def _in_threads(*calls):
    """Run each (function, kwargs) in its own thread at once; their results in order."""
    results = [None] * len(calls)

    def call(index, function, kwargs):
        results[index] = function(**kwargs)

    threads = [threading.Thread(target=call, args=(i, f, k)) for i, (f, k) in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _master_port(run, node):
    return re.search(r"master 127\.0\.0\.11:(\d+)", (run.attempt_dir / "nodes" / node / "run.log").read_text()).group(1)


@pytest.fixture(scope="module")
def two_jobs(lab_cluster, tmp_path_factory):
    """mode -> two dummy jobs started at the same moment on node1-3, each with its own results dir, one image cache:
    (runs, cache dir)."""

    def run_in(mode):
        base = tmp_path_factory.mktemp(f"two-jobs-{mode}")
        cache_dir = base / "image-cache"
        cache_dir.mkdir(mode=0o755)
        runs = _in_threads(
            *[
                (run_job, dict(results_dir=base / f"results-{n}", model_tags=["dummy"], image_cache_dir=str(cache_dir)))
                for n in ("a", "b")
            ]
        )
        return runs, cache_dir

    # Both jobs start in the same environment: the first one's output shows the mode of both.
    return once_per_mode(run_in, output=lambda made: made[0][0].output)


def test_two_jobs_at_once_on_the_same_nodes_both_succeed(two_jobs, pipeline_mode):
    runs, _ = two_jobs(pipeline_mode)
    for run in runs:
        assert run.rc == 0, run.output[-3000:]
        assert run.record["status"] == "SUCCESS"
    assert runs[0].job_id != runs[1].job_id


def test_two_jobs_at_once_use_their_own_master_ports(two_jobs, pipeline_mode):
    runs, _ = two_jobs(pipeline_mode)
    assert _master_port(runs[0], "node3") != _master_port(runs[1], "node3")


def test_two_jobs_at_once_share_one_cache_entry_with_no_leftovers(two_jobs, pipeline_mode):
    _, cache_dir = two_jobs(pipeline_mode)
    # The preflight stage's nonce dir is its own (each attempt's file pruned a day later), not a cache entry. The
    # cache's blobs dir is made by a publish's push target (the asking push after a whole save keeps no upload): empty.
    assert not any((cache_dir / "blobs").glob("*")), list((cache_dir / "blobs").iterdir())
    names = sorted(p.name for p in cache_dir.iterdir() if p.name not in (preflight.NONCE_DIR, "blobs"))
    markers = [n for n in names if n.endswith(".json")]
    assert len(markers) == 1, names
    assert names == sorted(markers + [markers[0][: -len(".json")] + ".tar"]), names


def test_two_jobs_at_once_leave_no_container(two_jobs, pipeline_mode):
    runs, _ = two_jobs(pipeline_mode)
    for run in runs:
        assert job_containers(run.job_id) == []


# --- runs that hold their containers while another job prepares ------------------------------------------------


def _zoo_with_a_waiting_model(destination: Path) -> Path:
    """A copy of models/ with `dummy_wait`: each rank prints its throughput once `release` is in its workspace."""
    shutil.copytree(ROOT / "models", destination)
    (destination / "scripts" / "dummy" / "run_wait.sh").write_text(
        '#!/bin/sh\n. "$(dirname "$0")/common.sh"\n'
        "while [ ! -e release ]; do sleep 0.5; done\n"
        'echo "performance: $((2000 + NODE_RANK)).5 samples_per_second"\n'
    )
    cards = json.loads((destination / "models.json").read_text())
    (dummy,) = [card for card in cards if card["name"] == "dummy"]
    cards.append(
        {**dummy, "name": "dummy_wait", "tags": ["dummy_wait"], "scripts": "scripts/dummy/run_wait.sh", "timeout": 1200}
    )
    (destination / "models.json").write_text(json.dumps(cards))
    return destination / "models.json"


def _running_containers(node: str, job_id: str) -> list:
    out = subprocess.run(
        [
            "docker",
            "--host",
            node_docker_host(node),
            "ps",
            "--filter",
            f"label=slurm-multi.job={job_id}",
            "--filter",
            "status=running",
            "--format",
            "{{.Names}}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _wait_for_running_containers(results_dir: Path, nodes, timeout: float = 600) -> str:
    """The job ID of the one run in `results_dir`, once its model container runs on every one of `nodes`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job_id in job_ids(results_dir):
            if all(_running_containers(node, job_id) for node in nodes):
                return job_id
        time.sleep(1)
    raise AssertionError(f"no run in {results_dir} had its containers running on {nodes} within {timeout} s")


def _release(results_dir: Path, job_id: str) -> None:
    """Let a `dummy_wait` run's ranks print their figures and exit."""
    workspaces = list((results_dir / job_id).glob("**/workspace"))
    assert workspaces, f"no workspace under {results_dir / job_id}"
    for workspace in workspaces:
        (workspace / "release").touch()


def _start_local_run(results_dir: Path, models_file: Path, cache_dir: Path) -> subprocess.Popen:
    """The real pipeline outside SLURM (one node: localhost) on node1's Docker daemon, as `ansible-playbook` alone."""
    results_dir.mkdir(mode=0o755)
    variables = {
        "results_dir": str(results_dir),
        "models_file": str(models_file),
        "model_tags": ["dummy_wait"],
        "image_cache_dir": str(cache_dir),
    }
    env = ansible_env(DOCKER_HOST=node_docker_host("node1"), MASTER_ADDR="127.0.0.1")
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "ansible-playbook"), "playbooks/run_multi.yml", "-e", json.dumps(variables)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def runs_beside_a_job(lab_cluster, tmp_path_factory):
    """mode -> a run outside SLURM on node1's daemon and a SLURM job on node1-3, both holding their model containers
    (running, waiting for a release file) while a third job (the user's, like theirs) runs from start to end on
    the same nodes. Then both are released. Returns a dict of what each saw."""

    def run_in(mode):
        base = tmp_path_factory.mktemp(f"beside-{mode}")
        models_file = _zoo_with_a_waiting_model(base / "zoo")
        cache_dir = base / "image-cache"
        cache_dir.mkdir(mode=0o755)
        local = _start_local_run(base / "results-local", models_file, cache_dir)
        waiting_job = {}
        thread = threading.Thread(
            target=lambda: waiting_job.update(
                run=run_job(
                    base / "results-waiting",
                    models_file=str(models_file),
                    model_tags=["dummy_wait"],
                    image_cache_dir=str(cache_dir),
                )
            )
        )
        thread.start()
        seen = {}
        try:
            seen["local_job"] = _wait_for_running_containers(base / "results-local", ["node1"])
            seen["waiting_job"] = _wait_for_running_containers(base / "results-waiting", NODES)
            seen["third"] = run_job(base / "results-third", model_tags=["dummy"], image_cache_dir=str(cache_dir))
            seen["local_after"] = _running_containers("node1", seen["local_job"])
            seen["waiting_after"] = {node: _running_containers(node, seen["waiting_job"]) for node in NODES}
        finally:
            for name in ("local_job", "waiting_job"):
                if name in seen:
                    _release(base / f"results-{name.split('_')[0]}", seen[name])
            seen["local_output"] = local.communicate(timeout=900)[0]
            seen["local_rc"] = local.returncode
            thread.join(timeout=900)
        seen["local_record"] = json.loads(
            (base / "results-local" / "records" / f"{seen['local_job']}.json").read_text()
        )
        seen["waiting"] = waiting_job["run"]
        return seen

    # The job under test: the third, which prepares beside the others (the waiting job starts in the same
    # environment; the run outside SLURM has no mode).
    return once_per_mode(run_in, output=lambda seen: seen["third"].output)


def test_a_job_preparing_beside_running_runs_of_the_same_user_leaves_their_containers(runs_beside_a_job, pipeline_mode):
    seen = runs_beside_a_job(pipeline_mode)
    assert seen["third"].rc == 0, seen["third"].output[-3000:]
    assert seen["third"].record["status"] == "SUCCESS"
    assert seen["local_after"], "the third job's preparation removed the run outside SLURM's container"
    assert all(seen["waiting_after"].values()), seen["waiting_after"]


def test_a_run_outside_slurm_beside_a_job_succeeds(runs_beside_a_job, pipeline_mode):
    seen = runs_beside_a_job(pipeline_mode)
    assert seen["local_job"].startswith("local-")
    assert seen["local_rc"] == 0, seen["local_output"][-3000:]
    assert seen["local_record"]["status"] == "SUCCESS", seen["local_record"]
    assert [float(row["performance"]) for row in seen["local_record"]["rows"]] == [2000.5]


def test_a_job_holding_its_containers_while_another_job_of_the_user_runs_succeeds(runs_beside_a_job, pipeline_mode):
    waiting = runs_beside_a_job(pipeline_mode)["waiting"]
    assert waiting.rc == 0, waiting.output[-3000:]
    assert waiting.record["status"] == "SUCCESS"
    assert job_containers(waiting.job_id) == []


# --- collect ----------------------------------------------------------------------------------------------------


def _collect(results_dir, job_id, model=None):
    extra = {"collect_job_id": job_id, "results_dir": str(results_dir), "collect_nodes": list(NODES)}
    if model:
        extra["collect_model"] = model
    return run_ansible(["ansible-playbook", "playbooks/collect.yml", "-e", json.dumps(extra)], timeout=300)


@pytest.fixture
def results(lab_cluster, tmp_path_factory):
    """(results dir holding an earlier successful job, its job ID, its perf row): a fresh copy for each test, so one
    test's collected jobs are never another's."""
    results_dir = tmp_path_factory.mktemp("collect") / "results"
    earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
    return results_dir, earlier_job, earlier_row


# collect.yml run by itself on the controller (no salloc, no pipeline, no mode var): once, not per mode.
@pytest.mark.mode_independent
def test_collecting_a_recorded_job_again_changes_nothing(results):
    results_dir, job_id, _ = results
    files = [
        results_dir / "records" / f"{job_id}.json",
        results_dir / "records" / f"{job_id}.csv",
        results_dir / "perf.csv",
    ]
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]
    collected = _collect(results_dir, job_id)
    assert collected.returncode == 0, collected.stdout[-3000:]
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == before


def _uncollected_copy(results_dir, job_id, new_job_id):
    """A copy of a finished job's node results under another job ID, not collected yet."""
    shutil.copytree(results_dir / job_id, results_dir / new_job_id)
    for status_file in (results_dir / new_job_id / "attempt-0" / "nodes").glob("*/status.json"):
        status = json.loads(status_file.read_text())
        status["job_id"] = new_job_id
        status_file.write_text(json.dumps(status))


# collect.yml run by itself on the controller (no salloc, no pipeline, no mode var): once, not per mode.
@pytest.mark.mode_independent
def test_two_jobs_collected_at_the_same_moment_both_get_their_rows(results):
    results_dir, job_id, earlier_row = results
    new_jobs = ["990001", "990002"]
    for new_job in new_jobs:
        _uncollected_copy(results_dir, job_id, new_job)
    collected = _in_threads(
        *[(_collect, dict(results_dir=results_dir, job_id=j, model={"name": f"dummy_{j}"})) for j in new_jobs]
    )
    for run in collected:
        assert run.returncode == 0, run.stdout[-3000:]
    models = sorted(row["model"] for row in perf_rows(results_dir))
    assert models == sorted([earlier_row["model"], "dummy_990001", "dummy_990002"]), models
    assert_earlier_job_intact(results_dir, job_id, earlier_row)
