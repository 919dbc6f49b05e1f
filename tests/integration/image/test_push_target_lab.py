"""A second local user of rank 0's node, knowing everything `ps` shows, attacks the push target of a real layered
publish (the build stage on the lab, rank 0 publishing only its new layer): it is let in nowhere, and the job's image
is published and loaded as if it were not there (issue 42, items 1-3; module_utils/image/cache/push_target.py)."""

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from slurm_multi.lab import cluster as lab
from tests.faults.test_shared_results_dir import PEER, _ensure_peer
from tests.integration.image.test_build_stage_lab import ROOT, _build_stage
from tests.support.ansible import task_results
from tests.support.lab.lab_nodes import name_the_base_by_a_registry_digest, node_docker_host

# mode_independent: build.yml alone, as test_build_stage_lab.py runs it (neither reads SLURM_MULTI_MODE).
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2", "node3")
# The model's own layer: random bytes, so that the daemon's gzip (and the attacker's window) takes about a second.
PAYLOAD_BYTES = 32 << 20
PUBLISH = "Hand rank 0's image to every node through the shared tar cache"


def _zoo_with_a_payload(tmp_path):
    """(models file, model name): the sample models plus one whose image adds PAYLOAD_BYTES of random data."""
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    dockerfile = (zoo / "docker" / "dummy.Dockerfile").read_text()
    payload = f"RUN echo $LAB_TEST_NONCE > /nonce && head -c {PAYLOAD_BYTES} /dev/urandom > /payload\n"
    dockerfile += "ARG LAB_TEST_NONCE\n" + payload
    (zoo / "docker" / "pushtarget.Dockerfile").write_text(dockerfile)
    cards = json.loads((zoo / "models.json").read_text())
    name = f"pushtarget{uuid.uuid4().hex[:8]}"
    dummy = next(card for card in cards if card["name"] == "dummy")
    cards.append(dict(dummy, name=name, tags=[name], dockerfile="docker/pushtarget"))
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo / "models.json", name


def _start_hostile_client(node):
    """The hostile client (tests/support/users/hostile_push_client.py) as the second user, in `node`'s namespaces (its
    /dev/shm), from a copy that user can read."""
    _ensure_peer()
    place = tempfile.mkdtemp(prefix="slurm-multi-hostile-")
    os.chmod(place, 0o755)
    script = shutil.copy(ROOT / "tests" / "support" / "users" / "hostile_push_client.py", place)
    os.chmod(script, 0o644)
    holder = lab.running_pid(f"{node}-holder", "sleep")
    argv = ["nsenter", "-t", str(holder), "-u", "-m", "runuser", "-u", PEER, "--", "/usr/bin/python3", script, "300"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), place


def _blob_files(cache):
    return {path.name: path for path in (cache / "blobs").iterdir()}


def test_a_second_user_who_sees_the_publishs_argv_gets_nothing_from_its_push_target(lab_cluster, tmp_path):
    cache = tmp_path / "cache"
    publish_image(CacheDirectory(str(cache), docker_host=node_docker_host("node1")), lab.BASE_IMAGE)
    name_the_base_by_a_registry_digest("node1")
    models_file, name = _zoo_with_a_payload(tmp_path)
    hostile, place = _start_hostile_client("node1")
    image_id = None
    try:
        output, _ = _build_stage(
            tmp_path, cache, uuid.uuid4().hex, verbose=True, models_file=str(models_file), model_tags=[name]
        )
        report_text, errors = hostile.communicate(timeout=120)
        published = task_results(output)[PUBLISH]["node1"]
        image_id = published["image_id"]

        # The job: published as layers (the push went through the flood), on every node.
        assert published["action_taken"] == "pushed", published
        marker = json.loads((cache / (image_id.split(":")[1] + ".json")).read_text())
        for node in NODES:
            held = subprocess.run(
                ["docker", "--host", node_docker_host(node), "image", "inspect", "--format", "{{.Id}}", image_id],
                capture_output=True,
                text=True,
            )
            assert held.stdout.strip() == image_id, (node, held.stderr)

        # The second user saw the target's reference (so it did attack the live target) and got only 401s, or a
        # connection the target dropped (the flood's, past its bound), or no target any more.
        report = json.loads(report_text or "{}")
        assert report.get("seen"), errors[-2000:]
        answered = {answer for counts in report["answers"].values() for answer in counts}
        assert "401" in answered and answered <= {
            "401",
            "ConnectionRefusedError",
            "ConnectionResetError",
            "BrokenPipeError",
            "RemoteDisconnected",
        }, report["answers"]
        assert "plant" not in report["answers"]  # no POST ever opened an upload
        # Nothing it read held a credential: the environments and the private configs were closed to it.
        learned = " ".join(report["neighbours"].values()) + report["seen"]
        assert set(report["neighbours"].values()) <= {"PermissionError", "FileNotFoundError"}, report["neighbours"]
        assert "Basic" not in learned and '"auth"' not in learned

        # The cache holds nothing of that user's: each blob is named by its bytes' sha256 and is one of the marker's.
        blobs = _blob_files(cache)
        named = {layer["blob"][7:] for layer in marker["layers"] if "blob" in layer} | {image_id[7:]}
        assert set(blobs) == named, sorted(blobs)
        assert all(hashlib.sha256(path.read_bytes()).hexdigest() == name for name, path in blobs.items())
        peer_uid = int(subprocess.run(["id", "-u", PEER], capture_output=True, text=True).stdout)
        assert all(path.stat().st_uid != peer_uid for path in cache.rglob("*"))

        # A later job's load: node3 without the image takes it from the cache again.
        subprocess.run(["docker", "--host", node_docker_host("node3"), "rmi", "-f", image_id], capture_output=True)
        later = load_image(CacheDirectory(str(cache), docker_host=node_docker_host("node3")), image_id)
        assert later.action_taken == "loaded" and later.details["layers_loaded"] >= 1
        assert CacheDirectory(str(cache), docker_host=node_docker_host("node3")).image_id_of(image_id) == image_id
    finally:
        if hostile.poll() is None:  # runuser passes a TERM on to the client
            hostile.terminate()
            hostile.wait(timeout=30)
        shutil.rmtree(place, ignore_errors=True)
        if image_id:
            for node in NODES:
                subprocess.run(["docker", "--host", node_docker_host(node), "rmi", "-f", image_id], capture_output=True)
