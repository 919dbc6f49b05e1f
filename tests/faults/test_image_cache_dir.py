"""An image cache dir others could plant a tar in, or one that cannot be written, stops the run with a clear error."""

import pytest

from tests.faults import FAULT_RUN_BOUND, assert_earlier_job_intact, job_containers, results_dir_with_baseline, run_job
from tests.support.per_mode_jobs import once_per_mode

pytestmark = [pytest.mark.lab, pytest.mark.fault]


@pytest.fixture(scope="module")
def results(lab_cluster, tmp_path_factory):
    """(results dir holding an earlier successful job, its job ID, its perf row)."""
    results_dir = tmp_path_factory.mktemp("cache-dir") / "results"
    earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
    return results_dir, earlier_job, earlier_row


@pytest.fixture(scope="module")
def world_writable_cache_run(results, tmp_path_factory):
    """mode -> (run, its image cache dir, mode 0777)."""

    def run_in(mode):
        cache_dir = tmp_path_factory.mktemp(f"world-writable-cache-{mode}")
        cache_dir.chmod(0o777)
        return run_job(results[0], model_tags=["dummy"], image_cache_dir=str(cache_dir)), cache_dir

    return once_per_mode(run_in, output=lambda made: made[0].output)


@pytest.fixture(scope="module")
def unwritable_cache_run(results, tmp_path_factory):
    """mode -> a run whose image cache dir cannot be created."""

    def run_in(mode):
        # Everything runs as root here, so no mode makes a directory unwritable: a path under a regular file is one
        # nobody can create, which is what a mistyped or unmounted shared path looks like to the tool.
        blocker = tmp_path_factory.mktemp(f"unwritable-cache-{mode}") / "not-a-directory"
        blocker.write_text("a file where the cache's parent directory should be\n")
        return run_job(results[0], model_tags=["dummy"], image_cache_dir=str(blocker / "cache"))

    return once_per_mode(run_in, output=lambda made: made.output)


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


@pytest.mark.parametrize("fault_run", ["world_writable_cache_run", "unwritable_cache_run"])
def test_the_cache_faults_leave_no_container_and_keep_the_earlier_job(fault_run, request, results, pipeline_mode):
    run = request.getfixturevalue(fault_run)(pipeline_mode)
    run = run[0] if isinstance(run, tuple) else run
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(*results)


def test_a_rerun_with_a_private_cache_dir_succeeds(results, world_writable_cache_run, pipeline_mode):
    _, cache_dir = world_writable_cache_run(pipeline_mode)
    cache_dir.chmod(0o755)
    rerun = run_job(results[0], model_tags=["dummy"], image_cache_dir=str(cache_dir))
    assert rerun.rc == 0, rerun.output[-3000:]
    assert [p.suffix for p in cache_dir.iterdir() if p.suffix == ".json"] == [".json"]
    assert_earlier_job_intact(*results)
