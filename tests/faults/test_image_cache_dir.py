"""An image cache dir others could plant a tar in, or one that cannot be written, stops the run with a clear error."""

import pytest

from tests.faults import (
    FAULT_RUN_BOUND,
    NODELIST,
    assert_earlier_job_intact,
    job_containers,
    results_dir_with_baseline,
    run_job,
    successful_baseline,
)
from tests.support.lab.per_mode_jobs import side_by_side

# lab_shared: each fault is its own job's cache dir; each run fails within seconds, far inside FAULT_RUN_BOUND.
# mode_independent (push, the default mode): the cache dir is checked by the image_cache module on rank 0, the same
# task in both modes; how a pull-mode node's stage failure reaches the record is the other fault tests' (the stream
# faults, rank 0's death, the model crash), in both modes.
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared, pytest.mark.mode_independent]


def _world_writable(base):
    cache_dir = base / "world-writable-cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    return cache_dir


def _uncreatable(base):
    # Everything runs as root here, so no mode makes a directory unwritable: a path under a regular file is one
    # nobody can create, which is what a mistyped or unmounted shared path looks like to the tool.
    blocker = base / "not-a-directory"
    blocker.write_text("a file where the cache's parent directory should be\n")
    return blocker / "cache"


CACHE_FAULTS = {"world_writable": _world_writable, "uncreatable": _uncreatable}


@pytest.fixture(scope="module")
def cache_fault_runs(lab_cluster, tmp_path_factory):
    """fault -> (results, run, its image cache dir): each fault's run, side by side (each fails within seconds; the
    bound they must meet is FAULT_RUN_BOUND). Each runs in a results dir of its own holding an earlier successful
    job: results is (that dir, the earlier job's ID, its perf row)."""

    def run(fault):
        base = tmp_path_factory.mktemp(f"cache-dir-{fault}")
        results = (base / "results", *results_dir_with_baseline(tmp_path_factory.getbasetemp(), base / "results"))
        cache_dir = CACHE_FAULTS[fault](base)
        return (
            results,
            run_job(results[0], nodelist=NODELIST, model_tags=["dummy"], image_cache_dir=str(cache_dir)),
            cache_dir,
        )

    successful_baseline(tmp_path_factory.getbasetemp())  # once, before the threads copy it
    return side_by_side({fault: (lambda fault=fault: run(fault)) for fault in CACHE_FAULTS})


def test_a_world_writable_cache_dir_is_refused_naming_the_fix(cache_fault_runs):
    _, run, cache_dir = cache_fault_runs["world_writable"]
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    reason = run.record["reason"]
    assert run.record["status"] == "FAILURE"
    assert f"image cache directory {cache_dir} is writable by other users" in reason, reason
    assert f"chmod go-w {cache_dir}" in reason, reason
    assert "node1" in reason, reason


def test_a_world_writable_cache_dir_gets_no_tar(cache_fault_runs):
    *_, cache_dir = cache_fault_runs["world_writable"]
    assert list(cache_dir.iterdir()) == []


def test_a_cache_dir_that_cannot_be_created_is_a_clear_error(cache_fault_runs):
    _, run, _ = cache_fault_runs["uncreatable"]
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    reason = run.record["reason"]
    assert run.record["status"] == "FAILURE"
    assert "cannot create the image cache directory" in reason and "Not a directory" in reason, reason


@pytest.mark.parametrize("fault", sorted(CACHE_FAULTS))
def test_the_cache_faults_leave_no_container_and_keep_the_earlier_job(fault, cache_fault_runs):
    results, run, _ = cache_fault_runs[fault]
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(*results)


def test_a_rerun_with_a_private_cache_dir_succeeds(cache_fault_runs):
    results, _, cache_dir = cache_fault_runs["world_writable"]
    cache_dir.chmod(0o755)
    rerun = run_job(results[0], model_tags=["dummy"], image_cache_dir=str(cache_dir))
    assert rerun.rc == 0, rerun.output[-3000:]
    assert [p.suffix for p in cache_dir.iterdir() if p.suffix == ".json"] == [".json"]
    assert_earlier_job_intact(*results)
