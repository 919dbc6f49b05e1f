"""Bad input (manifest, model zoo, hostlist, registry, additional context) is a clear error before any damage."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import (
    FAULT_RUN_BOUND,
    assert_earlier_job_intact,
    job_containers,
    job_ids,
    results_dir_with_baseline,
    run_job,
)
from tests.support.ansible import ROOT, ansible_env, run_ansible
from tests.support.per_mode_jobs import once_per_mode

pytestmark = [pytest.mark.lab, pytest.mark.fault]


@pytest.fixture(scope="module")
def results(lab_cluster, tmp_path_factory):
    """(results dir holding an earlier successful job, its job ID, its perf row)."""
    results_dir = tmp_path_factory.mktemp("bad-input") / "results"
    earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
    return results_dir, earlier_job, earlier_row


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


@pytest.fixture(scope="module", params=sorted(BAD_PIPELINE_INPUTS))
def bad_input_run(request, results, tmp_path_factory):
    """mode -> (input name, run, words its error must contain) for a pipeline run given one bad input."""
    make_vars, words = BAD_PIPELINE_INPUTS[request.param]

    def run_in(mode):
        extra_vars = make_vars(tmp_path_factory.mktemp(f"{request.param}-{mode}"))
        return request.param, run_job(results[0], model_tags=["dummy"], **extra_vars), words

    return once_per_mode(run_in, output=lambda made: made[1].output)


@pytest.mark.parametrize("bad_input_run", [name for name in sorted(BAD_PIPELINE_INPUTS)], indirect=True)
def test_bad_input_fails_the_run_with_a_reason_naming_it(bad_input_run, pipeline_mode):
    name, run, words = bad_input_run(pipeline_mode)
    assert run.rc != 0, run.output[-3000:]
    assert run.seconds < FAULT_RUN_BOUND
    assert run.record["status"] == "FAILURE"
    reason = run.record["reason"]
    assert all(word in reason for word in words), f"{name}: {reason}"


def test_bad_input_starts_no_container(bad_input_run, pipeline_mode):
    _, run, _ = bad_input_run(pipeline_mode)
    assert run.job_id is not None
    assert job_containers(run.job_id) == []


def test_bad_input_loses_no_earlier_record(bad_input_run, results, pipeline_mode):
    bad_input_run(pipeline_mode)  # the run that must not lose it
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
