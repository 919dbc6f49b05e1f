"""Bad input (manifest, model zoo, hostlist, registry, additional context) is a clear error before any damage."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import (
    FAULT_RUN_BOUND,
    NODELIST,
    assert_earlier_job_intact,
    job_containers,
    job_ids,
    results_dir_with_baseline,
    run_job,
    successful_baseline,
)
from tests.support.ansible import ROOT, ansible_env, run_ansible
from tests.support.lab.per_mode_jobs import MODES, in_mode, side_by_side

# lab_shared: each bad input fails its own job within seconds, far inside FAULT_RUN_BOUND.
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared]


def _broken_manifest(tmp: Path) -> dict:
    manifest = tmp / "build_manifest.json"
    manifest.write_text('{"built_images": {"dummy": {"docker_image": "dummy"}, ')
    return {"manifest_path": str(manifest)}


def _zoo_missing_its_dockerfile(tmp: Path) -> dict:
    zoo = tmp / "models"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "docker" / "dummy.Dockerfile").unlink()
    return {"models_file": str(zoo / "models.json")}


# Each bad input, the extra vars that carry it, and words its error must contain.
BAD_PIPELINE_INPUTS = {
    "malformed-manifest": (_broken_manifest, ["build_manifest.json"]),
    "missing-dockerfile": (_zoo_missing_its_dockerfile, ["docker/dummy", "Dockerfile"]),
    "malformed-registry": (lambda tmp: {"registry": "Docker.IO/My Org/bench"}, ["invalid registry"]),
    "additional-context-not-an-object": (
        lambda tmp: {"additional_context": '{"docker_env_vars": {'},
        ["additional_context"],
    ),
}


@pytest.fixture(scope="module")
def bad_input_runs(lab_cluster, tmp_path_factory):
    """(input name, mode) -> (results, run): the pipeline given each bad input in each mode, all eight runs side by
    side (each fails within seconds; the bound they must meet is FAULT_RUN_BOUND). Each runs in a results dir of its
    own, which holds an earlier successful job: results is (that dir, the earlier job's ID, its perf row)."""

    def run(name, mode):
        results_dir = tmp_path_factory.mktemp(f"bad-input-{name}-{mode}") / "results"
        results = (results_dir, *results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir))
        extra_vars = BAD_PIPELINE_INPUTS[name][0](tmp_path_factory.mktemp(f"{name}-{mode}"))
        return results, run_job(results_dir, mode=mode, nodelist=NODELIST, model_tags=["dummy"], **extra_vars)

    successful_baseline(tmp_path_factory.getbasetemp())  # once, before the threads copy it
    return side_by_side(
        {(name, mode): (lambda n=name, m=mode: run(n, m)) for name in BAD_PIPELINE_INPUTS for mode in MODES}
    )


@pytest.fixture(params=sorted(BAD_PIPELINE_INPUTS))
def bad_input_run(request, bad_input_runs):
    """mode -> (input name, run, words its error must contain, results) for a pipeline run given one bad input."""

    def run_in(mode):
        results, run = bad_input_runs[request.param, mode]
        return in_mode((request.param, run, BAD_PIPELINE_INPUTS[request.param][1], results), mode, run.output)

    return run_in


@pytest.mark.parametrize("bad_input_run", [name for name in sorted(BAD_PIPELINE_INPUTS)], indirect=True)
def test_bad_input_fails_the_run_with_a_reason_naming_it(bad_input_run, pipeline_mode):
    name, run, words, _ = bad_input_run(pipeline_mode)
    assert run.rc != 0, run.output[-3000:]
    assert run.seconds < FAULT_RUN_BOUND
    assert run.record["status"] == "FAILURE"
    reason = run.record["reason"]
    assert all(word in reason for word in words), f"{name}: {reason}"


def test_bad_input_starts_no_container(bad_input_run, pipeline_mode):
    _, run, _, _ = bad_input_run(pipeline_mode)
    assert run.job_id is not None
    assert job_containers(run.job_id) == []


def test_bad_input_loses_no_earlier_record(bad_input_run, pipeline_mode):
    *_, results = bad_input_run(pipeline_mode)  # the run that must not lose it
    assert_earlier_job_intact(*results)


# The inventory plugin alone (no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_a_malformed_hostlist_is_a_clear_inventory_error():
    env = ansible_env(SLURM_JOB_NODELIST="node[1-3", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="3")
    listed = run_ansible(["ansible-inventory", "--list"], env=env, timeout=120)
    assert listed.returncode != 0, listed.stdout
    assert "node[1-3" in listed.stderr and "SLURM_JOB_NODELIST" in listed.stderr, listed.stderr[-3000:]


# The CLI refuses before it submits anything (a --dry-run, no job, no pipeline): once, not per mode.
@pytest.mark.mode_independent
@pytest.mark.parametrize(
    "options, words",
    [
        (["--registry", "Docker.IO/My Org/bench"], ["invalid registry"]),
        (["-c", '{"docker_env_vars": {'], ["additional", "JSON"]),
    ],
    ids=["malformed-registry", "invalid-additional-context-json"],
)
def test_submit_refuses_bad_input_before_submitting(options, words, tmp_path):
    results_dir = tmp_path / "results"
    submitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_multi.cli",
            "submit",
            "-N",
            "3",
            "--tags",
            "dummy",
            "--results-dir",
            str(results_dir),
            "--dry-run",
            *options,
        ],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode != 0, submitted.stdout
    assert all(word in submitted.stderr for word in words), submitted.stderr[-3000:]
    assert job_ids(results_dir) == set()
