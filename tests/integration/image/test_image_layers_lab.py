"""Only the layers a node lacks move, on five lab nodes: a new image over a base the cache holds (an earlier job
published it), every node holds and rank 0's daemon knows by a registry digest (as a pulled base) reaches every
worker in seconds, with no tar written (module_utils/image/cache/publish.py and load.py). The three-node case is
test_build_stage_lab.py's third build."""

import json
import subprocess
import uuid

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import duration
from slurm_multi.lab import cluster as lab
from tests.support.lab.lab_nodes import name_the_base_by_a_registry_digest, node_docker_host
from tests.support.lab.pipeline import run_pipeline

# mode_independent: the publish and load modules are the same tasks in both modes (pull mode only hands the image ID
# over through the attempt dir, which every pull-mode pipeline run exercises). lab_serial: it grows the lab to five.
pytestmark = [pytest.mark.lab, pytest.mark.lab_serial, pytest.mark.mode_independent]

NODES = [f"node{i}" for i in range(1, 6)]
# The bound for a publish or a load of a few KB (each of them took under a second on the lab).
STEP_BOUND_SECONDS = 3.0


def test_a_new_image_over_a_cached_base_reaches_five_nodes_in_seconds(lab_cluster, tmp_path):
    lab.up(5, progress=lambda msg: None)
    cache = tmp_path / "image-cache"
    publish_image(CacheDirectory(str(cache), docker_host=node_docker_host("node1")), lab.BASE_IMAGE)
    name_the_base_by_a_registry_digest("node1")

    run = run_pipeline(
        tmp_path / "results",
        nodes=5,
        nodelist="node[1-5]",
        model_tags=["dummy"],
        image_cache_dir=str(cache),
        additional_context={"docker_build_arg": {"LAB_TEST_NONCE": uuid.uuid4().hex}},
    )

    assert run.rc == 0 and run.record["status"] == "SUCCESS", run.output[-4000:]
    (image_id,) = {run.record["per_node"][node]["image_id"] for node in NODES}
    try:
        entry = cache / (image_id.split(":", 1)[1] + ".json")
        assert json.loads(entry.read_text())["layers"] and not entry.with_suffix(".tar").exists()
        timeline = run.record["timeline"]
        steps = {"node1 publish": duration(timeline["node1"]["publish"])}
        steps.update({f"{node} load": duration(timeline[node]["load"]) for node in NODES[1:]})
        assert max(steps.values()) <= STEP_BOUND_SECONDS, steps
    finally:
        for node in NODES[1:]:
            subprocess.run(
                ["docker", "--host", node_docker_host(node), "image", "rm", "-f", image_id], capture_output=True
            )
