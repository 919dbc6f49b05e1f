"""The build stage on the lab: rank 0's image reaches every worker through the tar cache, once."""

import json
import re
import subprocess
import uuid

import pytest

from tests.support.ansible import ansible_env, run_ansible

pytestmark = pytest.mark.lab


def _build_stage(tmp_path, cache, nonce):
    variables = {"results_dir": str(tmp_path / "results"), "image_cache_dir": str(cache),
                 "model_tags": ["dummy"], "additional_context": {"docker_build_arg": {"LAB_TEST_NONCE": nonce}}}
    result = run_ansible(["ansible-playbook", "playbooks/build.yml", "-f", "3", "-e", json.dumps(variables)], nodes=3,
                         env=ansible_env(ANSIBLE_DISPLAY_SKIPPED_HOSTS="0"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    recap = dict(re.findall(r"^(node\d)\s+:.*changed=(\d+)", result.stdout, re.M))
    return result.stdout, {node: int(changed) for node, changed in recap.items()}


def _image_on(node, image_id):
    return subprocess.run(["srun", "-N1", "-w", node, "--quiet", "docker", "image", "inspect", image_id],
                          capture_output=True).returncode == 0


def test_image_built_on_rank0_reaches_workers_once_then_nothing_moves(lab_cluster, tmp_path):
    cache = tmp_path / "cache"
    nonce = uuid.uuid4().hex  # a new build arg: a new fingerprint label, so an image no node has yet
    output, changed = _build_stage(tmp_path, cache, nonce)
    (tar,) = cache.glob("*.tar")
    image_id = "sha256:" + tar.stem
    assert json.loads(tar.with_suffix(".json").read_text())["image_id"] == image_id
    assert all(_image_on(node, image_id) for node in ("node1", "node2", "node3")), output[-3000:]
    assert changed["node2"] >= 1 and changed["node3"] >= 1
    again_output, again = _build_stage(tmp_path, cache, nonce)
    # node1 writes this job's own build_manifest.json (changed); nothing is saved or loaded anywhere.
    assert (again["node2"], again["node3"]) == (0, 0), again_output[-3000:]
    assert re.search(r"Publish rank 0's image to the shared tar cache\] \*+\nok: \[node1\]", again_output)
    for node in ("node2", "node3"):
        subprocess.run(["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", image_id], capture_output=True)

