"""The streamed image transport on the lab (image_transport stream), in push and pull mode: rank 0's fresh image
reaches node2 and node3 through the chain node1 -> node2 -> node3 into their own Docker daemons, and the shared
cache entry is written on the way."""

import hashlib
import json
import subprocess
import uuid

import pytest

from tests.support.ansible import ansible_env
from tests.support.lab_nodes import node_docker_host
from tests.support.pipeline import run_pipeline

pytestmark = pytest.mark.lab

NODES = ("node1", "node2", "node3")


def image_id_on(node, reference):
    result = subprocess.run(
        ["docker", "--host", node_docker_host(node), "image", "inspect", "--format", "{{.Id}}", reference],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def stream_figures(run):
    return {rank: json.loads((run.attempt_dir / f"image_stream.rank{rank}.json").read_text()) for rank in range(3)}


def rank0_image_id(run):
    (manifest,) = run.job_dir.rglob("build_manifest.json")
    return next(iter(json.loads(manifest.read_text())["built_images"].values()))["image_id"]


@pytest.fixture
def stream_run(lab_cluster, tmp_path):
    """A stream-transport run of a fresh image (a new build arg: no node has it), with a cache dir of its own and a
    barrier token of its own (MAD_BARRIER_TOKEN), to look for afterwards."""
    cache_dir = tmp_path / "image-cache"
    token = f"stream-token-{uuid.uuid4().hex}"
    run = run_pipeline(
        tmp_path / "results",
        env=dict(ansible_env(), MAD_BARRIER_TOKEN=token),
        image_transport="stream",
        image_cache_dir=str(cache_dir),
        additional_context={"docker_build_arg": {"LAB_TEST_NONCE": uuid.uuid4().hex}},
    )
    return run, cache_dir, token


def test_a_stream_run_gives_every_node_rank0s_image_and_writes_the_cache_entry(stream_run):
    run, cache_dir, token = stream_run
    assert run.rc == 0, run.output[-4000:]
    assert run.record["status"] == "SUCCESS", run.record
    image_id = rank0_image_id(run)
    for node in NODES:
        assert image_id_on(node, image_id) == image_id, node
    figures = stream_figures(run)
    assert figures[0]["action_taken"] == "streamed", figures
    for rank in (1, 2):
        assert figures[rank]["action_taken"] == "streamed", figures
        assert figures[rank]["stream_error"] is None and figures[rank]["image_id"] == image_id
        assert figures[rank]["bytes"] == figures[0]["bytes"] > 0
    key = image_id.split(":", 1)[1]
    marker = json.loads((cache_dir / f"{key}.json").read_text())
    tar = cache_dir / f"{key}.tar"
    assert marker["sha256"] == hashlib.sha256(tar.read_bytes()).hexdigest() and marker["size"] == tar.stat().st_size
    # The workers got the image from the stream, not from the cache: each load step followed its node's stream.
    for node in ("node2", "node3"):
        assert "load" in run.status(node)["steps"], run.status(node)
    # The token authenticated every hop, and went nowhere: not in the output, the job's files or the cache.
    assert token not in run.output
    for path in [*run.results_dir.rglob("*"), *cache_dir.glob("*.json")]:
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
