"""A base loaded from a file costs its save once (issue 45): two jobs over the lab's PyTorch base, which every node
`docker import`ed (its daemon knows it by no registry digest, as a site's base from `docker load`), each rebuilding a
thin layer on it. The first job saves its image whole into an empty cache (that entry holds the base's layer) and
teaches rank 0's daemon a digest for the base (module_utils/image/cache/teach.py); the second job's publish pushes
only its own layer and config, and every worker loads only that layer.

Two real jobs on three nodes, read by every test here; the first job's whole save of the 1 GB image is its cost."""

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import duration
from slurm_multi.lab.pytorch import PYTORCH_BASE, ensure_pytorch_base
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.pipeline import run_pipeline

# mode_independent: the publish and the loads are the same in both modes.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2", "node3")
ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "loaded_base_zoo"
# The bound for the second job's publish and for every load.
STEP_BOUND_SECONDS = 3.0


def _docker(node, *args):
    return subprocess.run(["docker", "--host", node_docker_host(node), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_jobs(lab_cluster, tmp_path_factory):
    """(the cache dir, [the first job's run, the second's])."""
    ensure_pytorch_base(NODES)
    cache = tmp_path_factory.mktemp("loaded-base") / "image-cache"
    runs = [
        run_pipeline(
            tmp_path_factory.mktemp(f"loaded-base-job{index}") / "results",
            nodes=3,
            nodelist="node[1-3]",
            model_tags=["loaded_base_model"],
            models_file=str(ZOO / "models.json"),
            image_cache_dir=str(cache),
            additional_context={"docker_build_arg": {"MODEL_VERSION": uuid.uuid4().hex}},
        )
        for index in (1, 2)
    ]
    yield cache, runs
    for node in NODES:
        listed = _docker(node, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        for image in listed:
            if image.startswith("ci-loaded_base_model"):
                _docker(node, "image", "rm", "-f", image)


def _image_ids(run) -> set:
    return {run.record["per_node"][node]["image_id"] for node in NODES}


def test_no_node_knows_the_lab_base_by_a_registry_digest(two_jobs):
    for node in NODES:
        assert _docker(node, "image", "inspect", "--format", "{{json .RepoDigests}}", PYTORCH_BASE).stdout == "[]\n"


def test_each_job_runs_one_image_on_every_node_and_the_second_its_own(two_jobs):
    _, runs = two_jobs
    for run in runs:
        assert run.rc == 0 and run.record["status"] == "SUCCESS", run.output[-4000:]
    first, second = (_image_ids(run) for run in runs)
    assert len(first) == len(second) == 1 and first != second


def test_the_first_job_saves_its_image_whole_and_the_second_pushes_only_its_layer(two_jobs):
    cache, runs = two_jobs
    first, second = (cache / (_image_ids(run).pop().split(":", 1)[1] + ".json") for run in runs)
    assert first.with_suffix(".tar").is_file() and not json.loads(first.read_text()).get("layers")
    assert json.loads(second.read_text())["layers"] and not second.with_suffix(".tar").exists()


def test_the_second_jobs_publish_and_every_load_take_seconds(two_jobs):
    _, runs = two_jobs
    timeline = runs[1].record["timeline"]
    steps = {"node1 publish": duration(timeline["node1"]["publish"])}
    steps.update({f"{node} load": duration(timeline[node]["load"]) for node in NODES[1:]})
    print(f"second job: {steps}; first job's publish {duration(runs[0].record['timeline']['node1']['publish'])} s")
    assert max(steps.values()) <= STEP_BOUND_SECONDS, steps
