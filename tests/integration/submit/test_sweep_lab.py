"""Sweeps on the lab, through the command a user types (issue 17's acceptance lines): several images in one
allocation, each image built once, one record and one set of perf rows per model, and the job's exit code covering
them all.

Two sweeps per mode serve every test (one that succeeds, one that fails twice), all four submitted side by side,
`--no-exclusive` on the same nodes, each with a results dir of its own; nothing here asserts a time bound.
"""

import csv
import json
import shutil
from pathlib import Path

import pytest

from tests.integration.submit.test_submit_lab import _cli, _job_output
from tests.support.lab.per_mode_jobs import MODES, in_mode, side_by_side
from tests.support.lab.pipeline import MODE_ENV

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[3]


def _submit_sweep(tmp_path, mode, *args):
    results = tmp_path / "results"
    result = _cli(
        ["submit", "-N", "3", "--nodelist", "node[1-3]", "--no-exclusive", "--wait", "--results-dir", str(results)]
        + list(args),
        tmp_path,
        extra_env={MODE_ENV: mode},
        timeout=1500,
    )
    job_id = result.stdout.split("Submitted job ")[1].split()[0]
    return result, results, job_id


def _broken_zoo(base):
    """A copy of the sample models with one whose Dockerfile cannot build (it copies a file its context lacks)."""
    zoo = base / "models"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "docker" / "dummy_broken.Dockerfile").write_text(
        "# CONTEXT {'guest_os': 'UBUNTU'}\nFROM slurm-multi-lab/busybox:latest\nCOPY no-such-file /x\n"
    )
    cards = json.loads((zoo / "models.json").read_text())
    cards.append(dict(cards[0], name="dummy_broken", tags=["broken"], dockerfile="docker/dummy_broken"))
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo / "models.json"


# Two sweeps per mode serve every test: one whose runs all succeed (two models, the second a model whose two
# Dockerfile variants make two images), and one whose first model fails, the next succeeds and whose last image
# cannot build. (Each run a sweep holds is a pipeline run: the fewest that show each behaviour.)
SUCCEEDING = ["dummy_multiple_results", "dummy_ctxtest", "dummy_ctxtest"]
FAILING = [("dummy_fail", "FAILURE"), ("dummy_lastrank", "SUCCESS"), ("dummy_broken", "FAILURE")]
SWEEPS = {
    "succeeding": lambda base: ["--tags", *dict.fromkeys(SUCCEEDING), "-c", '{"ctx_test": 2}'],
    "failing": lambda base: ["--models-file", str(_broken_zoo(base)), "--tags", *(model for model, _ in FAILING)],
}


@pytest.fixture(scope="module")
def sweeps(lab_cluster, tmp_path_factory):
    """(kind, mode) -> (submit's result, results dir, job ID): every sweep, in both modes, side by side."""

    def submit(kind, mode):
        base = tmp_path_factory.mktemp(f"sweep-{kind}-{mode}")
        return _submit_sweep(base, mode, *SWEEPS[kind](base))

    every = [(kind, mode) for kind in SWEEPS for mode in MODES]
    return side_by_side({key: (lambda key=key: submit(*key)) for key in every})


def _sweep(sweeps, kind, mode):
    """That sweep, once its job's own Ansible output shows the mode it ran in."""
    _, results, job_id = sweeps[kind, mode]
    return in_mode(sweeps[kind, mode], mode, _job_output(results.parent, job_id))


def _record(results, job_id):
    return json.loads((results / "records" / f"{job_id}.json").read_text())


def _perf_rows(results):
    with open(results / "perf.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_models_run_in_one_allocation_with_a_record_each_and_every_image_built_once(sweeps, pipeline_mode):
    result, results, job_id = _sweep(sweeps, "succeeding", pipeline_mode)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert output.count("Submitted job ") == 1
    for index, name in enumerate(SUCCEEDING, start=1):
        assert f"model {index} of {len(SUCCEEDING)}: {name} (job {job_id}.{index})" in output, output[-5000:]
    sweep = _record(results, job_id)
    assert sweep["status"] == "SUCCESS", sweep
    assert [(entry["job_id"], entry["model"], entry["status"]) for entry in sweep["sweep"]] == [
        (f"{job_id}.{index}", name, "SUCCESS") for index, name in enumerate(SUCCEEDING, start=1)
    ]
    records = [_record(results, f"{job_id}.{index}") for index in range(1, len(SUCCEEDING) + 1)]
    for name, record in zip(SUCCEEDING, records, strict=True):
        assert record["status"] == "SUCCESS" and record["nodes"] == ["node1", "node2", "node3"], record
        assert all(row["model"].startswith(name) for row in record["rows"])
    # Every image built once, by the first model's run (the later runs take theirs from the sweep's manifest).
    manifest = json.loads((results / job_id / "attempt-0" / "build_manifest.json").read_text())
    assert [card["name"] for card in manifest["built_models"].values()] == SUCCEEDING
    # (A warm lab node may reuse an image another test built: the first run's build logs are not counted.)
    for index in range(2, len(SUCCEEDING) + 1):
        later = results / f"{job_id}.{index}" / "attempt-0"
        assert not list(later.glob("*.build.live.log")) and not (later / "build_manifest.json").exists()
    # perf.csv: each model's own rows, once (the sweep's record does not add them again).
    rows = _perf_rows(results)
    assert all(row["model"].startswith(tuple(SUCCEEDING)) for row in rows), rows
    assert len(rows) == sum(len(record["rows"]) for record in records), rows
    assert sum(row["model"].startswith("dummy_multiple_results_") for row in rows) > 1
    assert sum(row["model"].startswith("dummy_ctxtest") for row in rows) == 2


def test_multiple_results_csv_adds_one_row_per_csv_row(sweeps, pipeline_mode):
    # (The sweep's first model: no other test runs dummy_multiple_results.)
    _, results, job_id = _sweep(sweeps, "succeeding", pipeline_mode)
    rows = _record(results, f"{job_id}.1")["rows"]
    assert [(r["model"], r["performance"], r["status"]) for r in rows] == [
        ("dummy_multiple_results_bs1", "120.5", "SUCCESS"),
        ("dummy_multiple_results_bs8", "801.25", "SUCCESS"),
        ("dummy_multiple_results_bs32", "2950", "SUCCESS"),
    ]
    in_perf_csv = [(r["model"], r["performance"]) for r in _perf_rows(results) if r["model"].startswith(SUCCEEDING[0])]
    assert in_perf_csv == [(r["model"], r["performance"]) for r in rows]


def test_a_model_with_two_dockerfile_variants_runs_both_images_with_a_record_each(sweeps, pipeline_mode):
    _, results, job_id = _sweep(sweeps, "succeeding", pipeline_mode)
    dockerfiles = [_record(results, f"{job_id}.{index}")["rows"][0]["docker_file"] for index in (2, 3)]
    assert [name.rsplit("/", 1)[-1] for name in dockerfiles] == [
        "dummy_ctxtest.ctx2a.Dockerfile",
        "dummy_ctxtest.ctx2b.Dockerfile",
    ]
    manifest = json.loads((results / job_id / "attempt-0" / "build_manifest.json").read_text())
    variants = [name for name in manifest["built_images"] if "dummy_ctxtest" in name]
    assert len(variants) == 2, manifest["built_images"]


def test_a_failing_model_fails_the_job_but_not_the_models_after_it(sweeps, pipeline_mode):
    result, results, job_id = _sweep(sweeps, "failing", pipeline_mode)
    assert result.returncode != 0, (result.stdout + result.stderr)[-5000:]
    sweep = _record(results, job_id)
    assert [(entry["model"], entry["status"]) for entry in sweep["sweep"]] == FAILING, sweep
    assert sweep["status"] == "FAILURE" and f"dummy_fail (job {job_id}.1)" in sweep["reason"]
    statuses = {row["model"]: row["status"] for row in _perf_rows(results)}
    assert statuses["dummy_lastrank"] == "SUCCESS"
    assert statuses["dummy_fail"] == "FAILURE"


def test_an_image_that_fails_to_build_is_recorded_and_the_other_models_still_run(sweeps, pipeline_mode):
    _, results, job_id = _sweep(sweeps, "failing", pipeline_mode)
    sweep = _record(results, job_id)
    assert "dummy_broken" in sweep["reason"] and "failed to build" in sweep["reason"], sweep
    # The runs after the broken image's build still ran their models (the sweep's order above).
    assert _record(results, f"{job_id}.2")["status"] == "SUCCESS"
