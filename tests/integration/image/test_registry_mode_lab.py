"""Registry mode on the lab: rank 0 pushes to the lab's registry (docker-registry on 127.0.0.1), every node runs
the image by the digest of that push, and a tag moved after the push changes nothing.

The moved tag is made deterministic without any test-only code path: the first run builds and pushes (its manifest
records the tag and the digest); then another image, one that cannot run the model (its entrypoint is `false`), is
pushed to the same tag, the workers forget rank 0's image, and the second run starts from that manifest. Pulling by
tag would now fetch the other image and fail; pulling by digest fetches rank 0's.
"""

import json
import os
import subprocess
import uuid

import pytest

from slurm_multi.lab import cluster as lab
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.per_mode_jobs import both_modes_at_once
from tests.support.lab.pipeline import run_pipeline

pytestmark = pytest.mark.lab

# A repository of this session's own: a run elsewhere (another checkout's tests on the same lab) may move its tags.
# One per mode: each mode's first run pushes the same tag, and the [pull] copy of each test runs right after the
# [push] one: in one repository the pull run would move the tag the next [push] test reads.
REGISTRY = {
    mode: f"{lab.registry_url()}/slurm-multi-lab-test-{uuid.uuid4().hex[:8]}-{mode}" for mode in ("push", "pull")
}
WORKERS = ("node2", "node3")


def _docker_on(node, *args, stdin=None):
    # The classic builder: it builds FROM an image the daemon holds, offline.
    return subprocess.run(
        ["docker", "--host", node_docker_host(node), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DOCKER_BUILDKIT="0"),
    )


def _image_id_on(node, reference):
    result = _docker_on(node, "image", "inspect", "--format", "{{.Id}}", reference)
    return result.stdout.strip() if result.returncode == 0 else None


def _manifest_entry(run):
    (manifest,) = run.job_dir.rglob("build_manifest.json")
    return manifest, next(iter(json.loads(manifest.read_text())["built_images"].values()))


@pytest.fixture(scope="module")
def first_run(lab_cluster, tmp_path_factory):
    """mode -> a registry-mode run of a fresh image (a new build arg: no node has it): (run, manifest path, its
    entry); both modes' runs side by side, each to its own repository."""

    def run_fresh_image(mode):
        nonce = uuid.uuid4().hex
        run = run_pipeline(
            tmp_path_factory.mktemp(f"registry-{mode}") / "results",
            mode=mode,
            nodelist="node[1-3]",
            model_tags=["dummy"],
            registry=REGISTRY[mode],
            additional_context={"docker_build_arg": {"LAB_TEST_NONCE": nonce}},
        )
        assert run.rc == 0, run.output[-4000:]
        manifest, entry = _manifest_entry(run)
        return run, manifest, entry

    return both_modes_at_once(run_fresh_image, output=lambda made: made[0].output)


def test_a_registry_run_succeeds_and_every_node_holds_rank0s_push_by_digest(first_run, pipeline_mode):
    run, _, entry = first_run(pipeline_mode)
    assert run.record["status"] == "SUCCESS", run.record
    assert entry["registry_image"].startswith(f"{REGISTRY[pipeline_mode]}:")
    assert entry["registry_image_by_digest"].startswith(f"{REGISTRY[pipeline_mode]}@sha256:"), entry
    for node in ("node1", *WORKERS):
        assert _image_id_on(node, entry["registry_image_by_digest"]) == entry["image_id"], node


def _manifest_without(manifest, keys, destination):
    data = json.loads(manifest.read_text())
    for entry in data["built_images"].values():
        for key in keys:
            entry.pop(key, None)
    destination.write_text(json.dumps(data))
    return destination


def test_a_manifest_naming_only_a_tag_is_pinned_by_rank0_and_the_workers_pull_that_digest(
    first_run, tmp_path, pipeline_mode
):
    # A manifest MAD wrote: the tag, no digest. Runs before the tag is moved below.
    _, manifest, entry = first_run(pipeline_mode)
    for node in WORKERS:
        _docker_on(node, "image", "rm", "-f", entry["image_id"])
    tag_only = _manifest_without(manifest, ["registry_image_by_digest"], tmp_path / "build_manifest.json")
    run = run_pipeline(tmp_path / "results", registry=REGISTRY[pipeline_mode], manifest_path=str(tag_only))
    assert run.rc == 0, run.output[-4000:]
    for node in WORKERS:
        assert _image_id_on(node, entry["registry_image_by_digest"]) == entry["image_id"], node


def test_a_manifest_without_a_registry_image_is_a_clear_error_in_registry_mode(first_run, tmp_path, pipeline_mode):
    _, manifest, _ = first_run(pipeline_mode)
    local_only = _manifest_without(
        manifest, ["registry", "registry_image", "registry_image_by_digest"], tmp_path / "build_manifest.json"
    )
    run = run_pipeline(tmp_path / "results", registry=REGISTRY[pipeline_mode], manifest_path=str(local_only))
    assert run.rc != 0
    assert f"{local_only} names no registry_image for" in " ".join(run.output.split()), run.output[-3000:]


def test_a_tag_moved_after_rank0s_push_does_not_change_what_the_workers_run(first_run, tmp_path, pipeline_mode):
    _, manifest, entry = first_run(pipeline_mode)
    tag, pinned, image_id = entry["registry_image"], entry["registry_image_by_digest"], entry["image_id"]
    # Another image, unable to run the model, takes the tag rank 0 pushed (a new one: no node holds it yet).
    other = _docker_on(
        "node1",
        "build",
        "-q",
        "--network=host",
        "-t",
        tag,
        "-",
        stdin=f'FROM {lab.BASE_IMAGE}\nLABEL nonce={uuid.uuid4().hex}\nENTRYPOINT ["/bin/false"]\n',
    )
    assert other.returncode == 0, other.stderr
    other_id = _image_id_on("node1", tag)
    assert other_id != image_id
    assert all(_image_id_on(node, other_id) is None for node in WORKERS)
    pushed = _docker_on("node1", "push", tag)
    assert pushed.returncode == 0, pushed.stderr
    for node in WORKERS:  # the workers must pull: they no longer hold rank 0's image
        _docker_on(node, "image", "rm", "-f", image_id)
        assert _image_id_on(node, image_id) is None

    run = run_pipeline(tmp_path / "results", registry=REGISTRY[pipeline_mode], manifest_path=str(manifest))

    assert run.rc == 0, run.output[-4000:]
    assert run.record["status"] == "SUCCESS", run.record
    for node in WORKERS:
        assert _image_id_on(node, pinned) == image_id, node
        assert _image_id_on(node, other_id) is None, f"{node} pulled the image the moved tag names"
