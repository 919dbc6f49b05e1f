"""A base that moved is never run stale (issue 55): two jobs over one base tag, which is rebuilt on rank 0's daemon in
between. The model prints the version its base carries as its figure; the second job runs the new base (222, not the
111 of the image built over the old one) and its record names the new base's image ID (madengine's `docker_sha`).

Two real jobs on two nodes, read by every test here."""

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_multi.lab.cluster import BASE_IMAGE
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.pipeline import run_pipeline

# mode_independent: rank 0's build (build_images) decides reuse the same way in both modes.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2")
VERSIONS = ("111", "222")


def _docker(node, *args):
    return subprocess.run(
        ["docker", "--host", node_docker_host(node), *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def _build_base(tag, version, context: Path) -> str:
    """Build (again) the base `tag` on rank 0's daemon (node1's), holding `version` in /base-version; its image ID."""
    (context / "base-version").write_text(version + "\n")
    _docker("node1", "build", "-q", "--network=host", "-t", tag, str(context))
    return _docker("node1", "image", "inspect", "--format", "{{.Id}}", tag).strip()


def _zoo(root: Path, name: str) -> Path:
    """A zoo of one model, `name`, over MAD's `BASE_DOCKER`; its figure is the version its base carries."""
    (root / "docker").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "docker" / f"{name}.Dockerfile").write_text(f"ARG BASE_DOCKER={BASE_IMAGE}\nFROM $BASE_DOCKER\n")
    (root / "scripts" / "run.sh").write_text('#!/bin/sh\necho "performance: $(cat /base-version) samples_per_second"\n')
    card = {"name": name, "dockerfile": f"docker/{name}", "scripts": "scripts/run.sh", "tags": [name], "timeout": 120}
    (root / "models.json").write_text(json.dumps([card]))
    return root / "models.json"


@pytest.fixture(scope="module")
def two_jobs(lab_cluster, tmp_path_factory):
    """(the base's tag, [its ID in each job], [each job's run]): job 1 over base 111, job 2 after it was rebuilt as
    222 under the same tag."""
    work = tmp_path_factory.mktemp("moved-base")
    suffix = uuid.uuid4().hex[:8]
    tag, name = f"slurm-multi-test/moved-base:{suffix}", f"moved_base_{suffix}"
    context = work / "base"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nCOPY base-version /base-version\n")
    models_file = _zoo(work / "zoo", name)
    base_ids, runs = [], []
    try:
        for version in VERSIONS:
            base_ids.append(_build_base(tag, version, context))
            runs.append(
                run_pipeline(
                    work / f"results-{version}",
                    nodes=len(NODES),
                    nodelist="node[1-2]",
                    model_tags=[name],
                    models_file=str(models_file),
                    additional_context={"docker_build_arg": {"BASE_DOCKER": tag}},
                )
            )
        yield tag, base_ids, runs
    finally:
        for node in NODES:
            listed = _docker(node, "images", "--format", "{{.Repository}}:{{.Tag}}").split()
            for image in listed:
                if image == tag or image.startswith(f"ci-{name}"):
                    subprocess.run(
                        ["docker", "--host", node_docker_host(node), "rmi", "-f", image], capture_output=True
                    )


def test_the_base_was_rebuilt_under_the_same_tag_as_another_image(two_jobs):
    _, base_ids, _ = two_jobs
    assert base_ids[0] != base_ids[1]


def test_each_job_runs_the_base_its_rank_0_holds_when_it_starts(two_jobs):
    _, _, runs = two_jobs
    for run, version in zip(runs, VERSIONS, strict=True):
        assert run.rc == 0 and run.record["status"] == "SUCCESS", run.output[-4000:]
        assert [row["performance"] for row in run.record["rows"]] == [version], run.record["rows"]


def test_each_jobs_record_names_the_base_and_the_id_it_ran_over(two_jobs):
    tag, base_ids, runs = two_jobs
    for run, base_id in zip(runs, base_ids, strict=True):
        (row,) = run.record["rows"]
        assert (row["base_docker"], row["docker_sha"]) == (tag, base_id), run.record["rows"]
