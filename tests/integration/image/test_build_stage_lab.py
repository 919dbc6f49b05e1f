"""The build stage on the lab: rank 0's image reaches every worker through the tar cache, once; a build secret
reaches the build and nothing else."""

import base64
import hashlib
import json
import re
import shutil
import stat
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest
import yaml

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import user_cache_dir
from tests.support.ansible import ansible_env, run_ansible, task_results
from tests.support.buildkit import buildkit_docker_cli
from tests.support.lab.lab_nodes import name_the_base_by_a_registry_digest

# mode_independent: these tests run playbooks/build.yml themselves (run_ansible inside salloc, as push mode does),
# and neither build.yml nor run_ansible reads SLURM_MULTI_MODE: a [pull] copy ran the very same playbook again.
# Pull mode's build stage is exercised by every pull-mode pipeline run (tests/support/lab/pipeline.run_pipeline).
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

ROOT = Path(__file__).resolve().parents[3]
# The lab writes it (slurm_multi/lab/cluster.py): each node's address, and its shared /tmp image cache.
LAB_SITE_CONFIG = Path("/etc/slurm-multi/site.yml")

# One task on every node at once: rank 0 publishes, each worker loads (roles/build/tasks/cache.yml).
HANDOFF = "Hand rank 0's image to every node through the shared tar cache"


def _workers(results: dict):
    """(node, result) of the handoff's loads: every node's but rank 0's (node1), which published."""
    return [(node, result) for node, result in results.items() if node != "node1"]


def _build_stage(tmp_path, cache, nonce, verbose=False, **extra_variables):
    """Run playbooks/build.yml on node[1-3]; ``cache`` None gives no image_cache_dir, in a site whose config sets
    none either (the lab's own sets its shared /tmp), so the built-in default applies."""
    variables = {
        "results_dir": str(tmp_path / "results"),
        "model_tags": ["dummy"],
        "additional_context": {"docker_build_arg": {"LAB_TEST_NONCE": nonce}},
        **extra_variables,
    }
    env = ansible_env(ANSIBLE_DISPLAY_SKIPPED_HOSTS="0")
    if cache is None:
        site_config = tmp_path / "site.yml"
        addresses = yaml.safe_load(LAB_SITE_CONFIG.read_text())["node_addresses"]
        site_config.write_text(yaml.safe_dump({"node_addresses": addresses}))
        env["SLURM_MULTI_SITE_CONFIG"] = str(site_config)
    else:
        variables["image_cache_dir"] = str(cache)
    argv = ["ansible-playbook", "playbooks/build.yml", "-f", "3", "-e", json.dumps(variables)]
    if verbose:  # each task's result as one JSON line (tests.support.ansible.task_results reads them)
        argv.append("-v")
        env.update(ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_CALLBACK_FORMAT_PRETTY="0")
    result = run_ansible(argv, nodes=3, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    recap = dict(re.findall(r"^(node\d)\s+:.*changed=(\d+)", result.stdout, re.M))
    return result.stdout, {node: int(changed) for node, changed in recap.items()}


def _image_on(node, image_id):
    return (
        subprocess.run(
            ["srun", "-N1", "-w", node, "--quiet", "docker", "image", "inspect", image_id], capture_output=True
        ).returncode
        == 0
    )


def _zoo_with_a_model_of_its_own(tmp_path):
    """(models file, model name): the sample models plus `dummy` under a name of this test's own, so its image's
    tag is this test's alone. Another job building `dummy` on the shared lab at the same time moves `ci-dummy_...`
    to its own image, and the second run here would then find it moved and rebuild."""
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    cards = json.loads((zoo / "models.json").read_text())
    name = f"buildstage{uuid.uuid4().hex[:8]}"
    cards.append(dict(next(card for card in cards if card["name"] == "dummy"), name=name, tags=[name]))
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo / "models.json", name


def test_image_built_on_rank0_reaches_workers_once_then_nothing_moves(lab_cluster, tmp_path):
    # No image_cache_dir anywhere: the built-in default lies inside the results dir, which every node shares (a
    # /tmp default is node-local on a real cluster), and works on all three nodes.
    cache = Path(user_cache_dir(str(tmp_path / "results" / "image-cache-%u")))
    nonce = uuid.uuid4().hex  # a new build arg: a new fingerprint label, so an image no node has yet
    models_file, name = _zoo_with_a_model_of_its_own(tmp_path)
    model = {"models_file": str(models_file), "model_tags": [name]}
    output, changed = _build_stage(tmp_path, None, nonce, verbose=True, **model)
    (tar,) = cache.glob("*.tar")
    image_id = "sha256:" + tar.stem
    assert json.loads(tar.with_suffix(".json").read_text())["image_id"] == image_id
    assert all(_image_on(node, image_id) for node in ("node1", "node2", "node3")), output[-3000:]
    assert changed["node2"] >= 1 and changed["node3"] >= 1
    # Every node holds the lab's busybox base (and, from earlier jobs, the sample image's own layers, which a new
    # build arg leaves the same): each worker read at most the layers it lacked, never the base's
    # (module_utils/image/cache/layers.py); a whole-tar load reads it all and says no layer count.
    with tarfile.open(tar) as saved:
        (manifest,) = json.load(saved.extractfile("manifest.json"))
        base_layer = saved.getmember(manifest["Layers"][0])
    for node, loaded in _workers(task_results(output)[HANDOFF]):
        assert loaded["layers_loaded"] < len(manifest["Layers"]), (node, loaded)
        assert loaded["bytes"] < tar.stat().st_size - base_layer.size, (node, loaded)
    again_output, again = _build_stage(tmp_path, None, nonce, **model)
    # node1 writes this job's own build_manifest.json (changed); nothing is saved or loaded anywhere.
    assert (again["node2"], again["node3"]) == (0, 0), again_output[-3000:]
    assert "ok: [node1]" in again_output.split(f"{HANDOFF}] ")[1].split("TASK [")[0], again_output[-3000:]
    # The next image over the same layers (another build arg): rank 0 pushes what the cache lacks - the config, and
    # any layer its daemon cannot name by a registry digest - and no tar is written (module_utils/image/cache/
    # publish.py); every worker ends with the same image ID.
    name_the_base_by_a_registry_digest("node1")
    next_output, _ = _build_stage(tmp_path, None, uuid.uuid4().hex, verbose=True, **model)
    results = task_results(next_output)
    published = results[HANDOFF]["node1"]
    assert published["action_taken"] == "pushed" and published["bytes"] < tar.stat().st_size / 2, published
    assert len(list(cache.glob("*.tar"))) == 1  # the first build's: the third wrote none
    next_id = published["image_id"]
    assert json.loads((cache / (next_id.split(":")[1] + ".json")).read_text())["layers"]
    for node, loaded in _workers(results[HANDOFF]):
        assert loaded["action_taken"] == "loaded" and loaded["image_id"] == next_id, (node, loaded)
        # The issue's bound on the record's publish and load steps, these modules' times (5 nodes: image_layers_lab)
        assert max(published["seconds"], loaded["seconds"]) <= 3.0, (published, node, loaded)
    assert all(_image_on(node, next_id) for node in ("node1", "node2", "node3")), next_output[-3000:]
    for node in ("node2", "node3"):
        subprocess.run(
            ["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", image_id, next_id], capture_output=True
        )


def _docker_on(node, *args):
    return subprocess.run(
        ["srun", "-N1", "-w", node, "--quiet", "docker", *args], capture_output=True, text=True, check=True
    ).stdout


# The lab's base image (on every node); RUN reads the secret from BuildKit's mount, prints it and its base64 form
# (as `set -x` or `curl -v` would) and keeps only its sha256.
SECRET_MOUNT_DOCKERFILE = """# CONTEXT {'guest_os': 'UBUNTU'}
FROM slurm-multi-lab/busybox:latest
ARG LAB_TEST_NONCE=none
RUN --mount=type=secret,id=MAD_SECRETS_LAB_BUILD,required=true set -x && cat /run/secrets/MAD_SECRETS_LAB_BUILD \\
    && base64 /run/secrets/MAD_SECRETS_LAB_BUILD \\
    && sha256sum /run/secrets/MAD_SECRETS_LAB_BUILD | cut -d' ' -f1 > /build_secret.sha256 && echo "$LAB_TEST_NONCE"
"""


def test_build_secret_reaches_the_build_but_not_the_image_history_inspect_or_cache_tar(lab_cluster, tmp_path):
    secret = f"lab-build-secret-{uuid.uuid4().hex}"
    zoo = tmp_path / "zoo"
    (zoo / "docker").mkdir(parents=True)
    (zoo / "docker" / "secret_build.Dockerfile").write_text(SECRET_MOUNT_DOCKERFILE)
    (zoo / "models.json").write_text(
        json.dumps(
            [
                {
                    "name": "secret_build",
                    "dockerfile": "docker/secret_build",
                    "scripts": "scripts/run.sh",
                    "tags": ["secret_build"],
                }
            ]
        )
    )
    secrets_file = tmp_path / "secrets.env"
    secrets_file.write_text(f"MAD_SECRETS_LAB_BUILD={secret}\n")
    secrets_file.chmod(0o600)
    cache = tmp_path / "cache"

    output, _ = _build_stage(
        tmp_path,
        cache,
        uuid.uuid4().hex,
        models_file=str(zoo / "models.json"),
        model_tags=["secret_build"],
        secrets_file=str(secrets_file),
        buildkit_docker_cli=buildkit_docker_cli(),
    )

    (tar,) = cache.glob("*.tar")
    image_id = "sha256:" + tar.stem
    try:
        # The build saw the secret: the image holds its sha256, on rank 0 and on a worker that loaded the tar.
        for node in ("node1", "node3"):
            seen = _docker_on(node, "run", "--rm", "--network=none", image_id, "cat", "/build_secret.sha256")
            assert seen.strip() == hashlib.sha256(secret.encode()).hexdigest()
        # ...and left it nowhere: image history, image config, the cache tar (published by the real image_cache
        # module), its marker, the manifest and build log, Ansible's output.
        history = _docker_on("node1", "history", "--no-trunc", image_id)
        assert "sha256sum /run/secrets/MAD_SECRETS_LAB_BUILD" in history  # the step is recorded, not its secret
        for trace in (
            history,
            _docker_on("node1", "image", "inspect", image_id),
            _docker_on("node2", "image", "inspect", image_id),
            tar.with_suffix(".json").read_text(),
            *(path.read_text() for path in (tmp_path / "results").rglob("*") if path.is_file()),
            output,
        ):
            assert secret not in trace and base64.b64encode(secret.encode()).decode() not in trace
        (build_log,) = (tmp_path / "results").rglob("*.build.live.log")
        assert "+ cat /run/secrets/MAD_SECRETS_LAB_BUILD" in build_log.read_text()  # the step printed it, masked
        assert stat.S_IMODE(build_log.stat().st_mode) == 0o640
        assert secret.encode() not in tar.read_bytes()
        # Cache entries are readable by their owner only.
        assert (tar.stat().st_mode & 0o777, tar.with_suffix(".json").stat().st_mode & 0o777) == (0o600, 0o600)
        assert cache.stat().st_mode & 0o777 == 0o700
    finally:
        for node in ("node1", "node2", "node3"):
            subprocess.run(["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", image_id], capture_output=True)


def test_the_manifest_rank_0_writes_records_the_jobs_deployment_config(lab_cluster, tmp_path):
    slurm = {"nodes": 3, "partition": "lab", "time": "00:30:00"}
    context = {
        "docker_build_arg": {"LAB_TEST_NONCE": "deployment-config"},  # the same image each run: built once
        "slurm": slurm,
        "distributed": {"launcher": "torchrun"},
    }
    output, _ = _build_stage(tmp_path, tmp_path / "cache", "", additional_context=context)
    (manifest,) = (tmp_path / "results").rglob("build_manifest.json")
    assert json.loads(manifest.read_text())["deployment_config"] == {
        "slurm": slurm,
        "distributed": {"launcher": "torchrun"},
    }, output[-3000:]
