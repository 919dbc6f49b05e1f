"""Two jobs on the same nodes at once, and collecting jobs twice or at the same moment into one results dir."""

import json
import re
import shutil
import threading

import pytest

from tests.faults import (NODES, assert_earlier_job_intact, job_containers, perf_rows, results_dir_with_baseline,
                          run_job)
from tests.support.ansible import run_ansible

pytestmark = [pytest.mark.lab, pytest.mark.fault]


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
    return re.search(r"master 127\.0\.0\.11:(\d+)", (run.job_dir / "nodes" / node / "run.log").read_text()).group(1)


@pytest.fixture(scope="module")
def two_jobs(lab_cluster, tmp_path_factory):
    """Two dummy jobs started at the same moment on node1-3, each with its own results dir, one image cache."""
    base = tmp_path_factory.mktemp("two-jobs")
    cache_dir = base / "image-cache"
    cache_dir.mkdir(mode=0o755)
    runs = _in_threads(*[(run_job, dict(results_dir=base / f"results-{n}", model_tags=["dummy"],
                                        image_cache_dir=str(cache_dir))) for n in ("a", "b")])
    return runs, cache_dir


def test_two_jobs_at_once_on_the_same_nodes_both_succeed(two_jobs):
    runs, _ = two_jobs
    for run in runs:
        assert run.rc == 0, run.output[-3000:]
        assert run.record["status"] == "SUCCESS"
    assert runs[0].job_id != runs[1].job_id


def test_two_jobs_at_once_use_their_own_master_ports(two_jobs):
    runs, _ = two_jobs
    assert _master_port(runs[0], "node3") != _master_port(runs[1], "node3")


def test_two_jobs_at_once_share_one_cache_entry_with_no_leftovers(two_jobs):
    _, cache_dir = two_jobs
    names = sorted(p.name for p in cache_dir.iterdir())
    markers = [n for n in names if n.endswith(".json")]
    assert len(markers) == 1, names
    assert names == sorted(markers + [markers[0][:-len(".json")] + ".tar"]), names


def test_two_jobs_at_once_leave_no_container(two_jobs):
    runs, _ = two_jobs
    for run in runs:
        assert job_containers(run.job_id) == []


# --- collect ----------------------------------------------------------------------------------------------------


def _collect(results_dir, job_id, model=None):
    extra = {"collect_job_id": job_id, "results_dir": str(results_dir), "collect_nodes": list(NODES)}
    if model:
        extra["collect_model"] = model
    return run_ansible(["ansible-playbook", "playbooks/collect.yml", "-e", json.dumps(extra)], timeout=300)


@pytest.fixture(scope="module")
def results(lab_cluster, tmp_path_factory):
    """(results dir holding an earlier successful job, its job ID, its perf row)."""
    results_dir = tmp_path_factory.mktemp("collect") / "results"
    earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
    return results_dir, earlier_job, earlier_row


def test_collecting_a_recorded_job_again_changes_nothing(results):
    results_dir, job_id, _ = results
    files = [results_dir / "records" / f"{job_id}.json", results_dir / "records" / f"{job_id}.csv",
             results_dir / "perf.csv"]
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]
    collected = _collect(results_dir, job_id)
    assert collected.returncode == 0, collected.stdout[-3000:]
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == before


def _uncollected_copy(results_dir, job_id, new_job_id):
    """A copy of a finished job's node results under another job ID, not collected yet."""
    shutil.copytree(results_dir / job_id, results_dir / new_job_id)
    for status_file in (results_dir / new_job_id / "nodes").glob("*/status.json"):
        status = json.loads(status_file.read_text())
        status["job_id"] = new_job_id
        status_file.write_text(json.dumps(status))


def test_two_jobs_collected_at_the_same_moment_both_get_their_rows(results):
    results_dir, job_id, earlier_row = results
    new_jobs = ["990001", "990002"]
    for new_job in new_jobs:
        _uncollected_copy(results_dir, job_id, new_job)
    collected = _in_threads(*[(_collect, dict(results_dir=results_dir, job_id=j, model={"name": f"dummy_{j}"}))
                              for j in new_jobs])
    for run in collected:
        assert run.returncode == 0, run.stdout[-3000:]
    models = sorted(row["model"] for row in perf_rows(results_dir))
    assert models == sorted([earlier_row["model"], "dummy_990001", "dummy_990002"]), models
    assert_earlier_job_intact(results_dir, job_id, earlier_row)
