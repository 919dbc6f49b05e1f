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
from tests.support.per_mode_jobs import MODES, in_mode, side_by_side

# lab_shared: each fault is its own job's cache dir; each run fails within seconds, far inside FAULT_RUN_BOUND.
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared]


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
    """(fault, mode) -> (results, run, its image cache dir): each fault in each mode, the four runs side by side
    (each fails within seconds; the bound they must meet is FAULT_RUN_BOUND). Each runs in a results dir of its own
    holding an earlier successful job: results is (that dir, the earlier job's ID, its perf row)."""

    def run(fault, mode):
        base = tmp_path_factory.mktemp(f"cache-dir-{fault}-{mode}")
        results = (base / "results", *results_dir_with_baseline(tmp_path_factory.getbasetemp(), base / "results"))
        cache_dir = CACHE_FAULTS[fault](base)
        return (
            results,
            run_job(results[0], mode=mode, nodelist=NODELIST, model_tags=["dummy"], image_cache_dir=str(cache_dir)),
            cache_dir,
        )

    successful_baseline(tmp_path_factory.getbasetemp())  # once, before the threads copy it
    every = [(fault, mode) for fault in CACHE_FAULTS for mode in MODES]
    return side_by_side({key: (lambda key=key: run(*key)) for key in every})


def _fault_run(cache_fault_runs, fault, mode):
    made = cache_fault_runs[fault, mode]
    return in_mode(made, mode, made[1].output)


@pytest.fixture
def world_writable_cache_run(cache_fault_runs):
    """mode -> (run, its image cache dir, mode 0777)."""
    return lambda mode: _fault_run(cache_fault_runs, "world_writable", mode)[1:]


@pytest.fixture
def unwritable_cache_run(cache_fault_runs):
    """mode -> a run whose image cache dir cannot be created."""
    return lambda mode: _fault_run(cache_fault_runs, "uncreatable", mode)[1]


@pytest.fixture
def results(cache_fault_runs):
    """mode -> the results dir of the world-writable run: (dir, the earlier job's ID, its perf row)."""
    return lambda mode: _fault_run(cache_fault_runs, "world_writable", mode)[0]


def test_a_world_writable_cache_dir_is_refused_naming_the_fix(world_writable_cache_run, pipeline_mode):
    run, cache_dir = world_writable_cache_run(pipeline_mode)
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    reason = run.record["reason"]
    assert run.record["status"] == "FAILURE"
    assert f"image cache directory {cache_dir} is writable by other users" in reason, reason
    assert f"chmod go-w {cache_dir}" in reason, reason
    assert "node1" in reason, reason


def test_a_world_writable_cache_dir_gets_no_tar(world_writable_cache_run, pipeline_mode):
    _, cache_dir = world_writable_cache_run(pipeline_mode)
    assert list(cache_dir.iterdir()) == []


def test_a_cache_dir_that_cannot_be_created_is_a_clear_error(unwritable_cache_run, pipeline_mode):
    run = unwritable_cache_run(pipeline_mode)
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    reason = run.record["reason"]
    assert run.record["status"] == "FAILURE"
    assert "cannot create the image cache directory" in reason and "Not a directory" in reason, reason


@pytest.mark.parametrize("fault", sorted(CACHE_FAULTS))
def test_the_cache_faults_leave_no_container_and_keep_the_earlier_job(fault, cache_fault_runs, pipeline_mode):
    results, run, _ = _fault_run(cache_fault_runs, fault, pipeline_mode)
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(*results)


def test_a_rerun_with_a_private_cache_dir_succeeds(results, world_writable_cache_run, pipeline_mode):
    _, cache_dir = world_writable_cache_run(pipeline_mode)
    cache_dir.chmod(0o755)
    rerun = run_job(results(pipeline_mode)[0], model_tags=["dummy"], image_cache_dir=str(cache_dir))
    assert rerun.rc == 0, rerun.output[-3000:]
    assert [p.suffix for p in cache_dir.iterdir() if p.suffix == ".json"] == [".json"]
    assert_earlier_job_intact(*results(pipeline_mode))
