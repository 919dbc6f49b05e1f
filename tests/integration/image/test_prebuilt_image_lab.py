"""Prebuilt images on the lab (MAD's --use-image and --manifest): a job runs an image it did not build.

* `submit --use-image` naming a local image that only node1's daemon holds: rank 0 writes the job's manifest for it (no
  build, no build log), the tar cache hands it to node2 and node3, and all three run it.
* `use_image` naming a registry image: every node runs it by the digest rank 0 pinned.
* `manifest_path`: a manifest's context comes back under the run's own values (what the container sees).
"""

import getpass
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_multi.lab import cluster as lab
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.pipeline import run_pipeline

pytestmark = pytest.mark.lab

NODES = ("node1", "node2", "node3")
ZOO = os.path.join(os.path.dirname(__file__), "..", "..", "..", "models")


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


def _build_on_node1(tag):
    """An image no node has seen (a new label), on node1 alone; its ID."""
    built = _docker_on(
        "node1", "build", "-q", "--network=host", "-t", tag, "-", stdin=f"FROM {lab.BASE_IMAGE}\nLABEL nonce={tag}\n"
    )
    assert built.returncode == 0, built.stderr
    return _image_id_on("node1", tag)


def _manifest_entry(run):
    manifest = json.loads((run.attempt_dir / "build_manifest.json").read_text())
    ((name, entry),) = manifest["built_images"].items()
    return name, entry, manifest


def test_submit_use_image_of_an_image_only_node1_holds_runs_on_three_nodes_without_a_build(lab_cluster, tmp_path):
    # The acceptance line, through the command a user types.
    from tests.integration.submit.test_submit_lab import _cli

    tag = f"slurm-multi-lab-prebuilt:{uuid.uuid4().hex[:12]}"
    image_id = _build_on_node1(tag)
    assert [_image_id_on(node, image_id) for node in NODES[1:]] == [None, None]
    results = tmp_path / "results"
    try:
        args = ["submit", "-N", "3", "--no-exclusive", "--tags", "dummy", "--use-image", tag, "--wait"]
        result = _cli([*args, "--results-dir", str(results)], tmp_path, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (job_dir,) = [path for path in results.iterdir() if path.name != "records" and path.is_dir()]
        record = json.loads((results / "records" / f"{job_dir.name}.json").read_text())
        assert record["status"] == "SUCCESS", record
        assert not list(job_dir.rglob("*.build.live.log")), "a build ran"
        # Rank 0 wrote the job's manifest for the image it did not build.
        manifest = json.loads((job_dir / "attempt-0" / "build_manifest.json").read_text())
        ((name, entry),) = manifest["built_images"].items()
        assert (name, entry["prebuilt"], entry["image_id"], entry["dockerfile"]) == (tag, True, image_id, "")
        assert manifest["built_models"][tag]["name"] == "dummy"
        # Every node ran the very image node1 held, and the workers got it from the (default) cache.
        assert [_image_id_on(node, tag) for node in NODES] == [image_id] * 3
        cache_dir = Path(f"/tmp/slurm-multi-image-cache-{getpass.getuser()}")
        # Its entry: a tar, or a layered entry's marker when the cache held its base from an earlier job.
        assert (cache_dir / f"{image_id.split(':', 1)[1]}.json").is_file()
        for node in record["nodes"]:
            assert "samples_per_second" in (job_dir / "attempt-0" / "nodes" / node / "run.log").read_text()
    finally:
        for node in NODES:
            _docker_on(node, "image", "rm", "-f", image_id)


def test_a_registry_image_runs_by_the_digest_rank0_pinned(lab_cluster, tmp_path):
    tag = f"{lab.registry_url()}/slurm-multi-lab-prebuilt-{uuid.uuid4().hex[:8]}:v1"
    image_id = _build_on_node1(tag)
    pushed = _docker_on("node1", "push", tag)
    assert pushed.returncode == 0, pushed.stderr
    _docker_on("node1", "image", "rm", "-f", tag)  # no node holds it: every node pulls
    run = run_pipeline(tmp_path / "results", model_tags=["dummy"], use_image=tag)
    assert run.rc == 0, run.output[-4000:]
    assert run.record["status"] == "SUCCESS", run.record
    assert not list(run.attempt_dir.glob("*.build.live.log")), "a build ran"
    _, entry, _ = _manifest_entry(run)
    assert entry["registry_image"] == tag
    for node in NODES:
        assert _image_id_on(node, image_id) == image_id, node
        digests = _docker_on(node, "image", "inspect", "--format", "{{json .RepoDigests}}", image_id).stdout
        assert tag.rsplit(":", 1)[0] + "@sha256:" in digests, (node, digests)
        _docker_on(node, "image", "rm", "-f", image_id)


def _probe_zoo(root, name):
    """A zoo whose model `name` prints two variables of its container's environment, then a metric.

    A name of the test's own: its image (ci-<name>_probe) is no other test's, which may remove or rebuild theirs.
    """
    (root / "docker").mkdir(parents=True)
    (root / "scripts" / "probe").mkdir(parents=True)
    dockerfile = open(os.path.join(ZOO, "docker", "dummy.Dockerfile"), encoding="utf-8").read()
    (root / "docker" / "probe.Dockerfile").write_text(dockerfile)
    (root / "scripts" / "probe" / "run.sh").write_text(
        'echo "seen: FROM_MANIFEST=$FROM_MANIFEST OVERRIDDEN=$OVERRIDDEN"\necho "performance: 1.5 samples_per_second"\n'
    )
    card = {"name": name, "dockerfile": "docker/probe", "scripts": "scripts/probe/run.sh"}
    (root / "models.json").write_text(json.dumps([card]))
    return root / "models.json"


# Push mode only (the default): every node's preparation restores the context with the same filter in both modes
# (restore_run_context); the modes differ in who reaches the node, which the other tests here cover in both.
@pytest.mark.mode_independent
def test_a_manifest_run_restores_the_manifests_context_under_the_runs_own(lab_cluster, tmp_path):
    name = f"ctx_probe_{uuid.uuid4().hex[:8]}"
    models_file = _probe_zoo(tmp_path / "zoo", name)
    built = run_pipeline(
        tmp_path / "built",
        model_tags=[name],
        models_file=str(models_file),
        additional_context={"docker_env_vars": {"FROM_MANIFEST": "manifest", "OVERRIDDEN": "manifest"}},
    )
    assert built.rc == 0, built.output[-4000:]
    manifest = built.attempt_dir / "build_manifest.json"
    assert json.loads(manifest.read_text())["context"]["docker_env_vars"]["FROM_MANIFEST"] == "manifest"
    run = run_pipeline(
        tmp_path / "rerun",
        model_tags=[name],
        models_file=str(models_file),
        manifest_path=str(manifest),
        additional_context={"docker_env_vars": {"OVERRIDDEN": "runtime"}},
    )
    assert run.rc == 0, run.output[-4000:]
    assert not list(run.attempt_dir.glob("*.build.live.log")), "a build ran"
    assert not (run.attempt_dir / "build_manifest.json").exists()
    for node in NODES:
        log = (run.attempt_dir / "nodes" / node / "run.log").read_text()
        assert "seen: FROM_MANIFEST=manifest OVERRIDDEN=runtime" in log, (node, log[-2000:])
