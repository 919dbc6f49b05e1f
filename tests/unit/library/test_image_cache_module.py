"""The image_cache module as Ansible runs it (`ansible-playbook` and `ansible` on localhost, local connection),
against real Docker daemons: rank 0's (the session's private daemon) and a worker's."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import image_id

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Publish the image to the shared cache
      image_cache: {state: published, image: "{{ image }}", cache_dir: "{{ cache_dir }}"}
      environment: {DOCKER_HOST: "{{ rank0_host }}"}
      register: first_publish

    - name: Publish it again
      image_cache: {state: published, image: "{{ image }}", cache_dir: "{{ cache_dir }}"}
      environment: {DOCKER_HOST: "{{ rank0_host }}"}
      register: second_publish

    - name: Load the announced image on the worker
      image_cache: {state: loaded, image_id: "{{ first_publish.image_id }}", cache_dir: "{{ cache_dir }}"}
      environment: {DOCKER_HOST: "{{ worker_host }}"}
      register: first_load

    - name: Load it again
      image_cache: {state: loaded, image_id: "{{ first_publish.image_id }}", cache_dir: "{{ cache_dir }}"}
      environment: {DOCKER_HOST: "{{ worker_host }}"}
      register: second_load

    - name: Record the results
      copy:
        dest: "{{ results_file }}"
        content: "{{ {'first_publish': first_publish, 'second_publish': second_publish,
                      'first_load': first_load, 'second_load': second_load} | to_json }}"
"""


def ansible_env(**extra):
    env = dict(
        os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_DEPRECATION_WARNINGS="false", ANSIBLE_NOCOLOR="1"
    )
    env.pop("MAD_DOCKER_BUILDS", None)
    env.update(extra)
    return env


def ansible_command(program, *args):
    return [
        str(BIN / program),
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        *args,
    ]


def run_module(tmp_path, module_args, *options, **env):
    """(exit code, the module's result as the tree callback records it) of one `ansible localhost -m image_cache`."""
    tree = tmp_path / f"tree-{uuid.uuid4().hex[:8]}"
    completed = subprocess.run(
        ansible_command("ansible", "localhost", "-m", "image_cache", "-a", json.dumps(module_args), *options),
        env=ansible_env(
            ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
            ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree",
            ANSIBLE_CALLBACK_TREE_DIR=str(tree),
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (tree / "localhost").exists(), completed.stdout + completed.stderr
    return completed.returncode, json.loads((tree / "localhost").read_text())


@pytest.fixture(scope="module")
def playbook_run(private_dockerd, worker_dockerd, busybox_image, tmp_path_factory):
    """The results of one playbook: publish twice on rank 0, then load twice on the worker."""
    workdir = tmp_path_factory.mktemp("image-cache-module")
    worker_dockerd.docker("rmi", "-f", busybox_image[1], check=False)
    (workdir / "playbook.yml").write_text(PLAYBOOK)
    cache_dir = workdir / "docker-builds"
    variables = {
        "image": busybox_image[0],
        "cache_dir": str(cache_dir),
        "rank0_host": private_dockerd.host,
        "worker_host": worker_dockerd.host,
        "results_file": str(workdir / "results.json"),
    }
    completed = subprocess.run(
        ansible_command("ansible-playbook", "-e", json.dumps(variables), str(workdir / "playbook.yml")),
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads((workdir / "results.json").read_text())


def test_published_saves_the_image_into_a_new_cache_dir(playbook_run, busybox_image):
    result = playbook_run["first_publish"]

    assert (result["action_taken"], result["changed"], result["image_id"]) == ("saved", True, busybox_image[1])
    assert os.path.getsize(result["entry"]) == result["bytes"] > 0
    assert os.path.exists(result["entry"][: -len(".tar")] + ".json")


def test_published_again_reports_no_change(playbook_run):
    result = playbook_run["second_publish"]

    assert (result["action_taken"], result["changed"]) == ("already-present", False)


def test_loaded_gives_the_worker_the_announced_image(playbook_run, worker_dockerd, busybox_image):
    result = playbook_run["first_load"]

    assert (result["action_taken"], result["changed"], result["image_id"]) == ("loaded", True, busybox_image[1])
    assert image_id(busybox_image[1], host=worker_dockerd.host) == busybox_image[1]


def test_loaded_again_reports_no_change(playbook_run):
    result = playbook_run["second_load"]

    assert (result["action_taken"], result["changed"]) == ("already-present", False)


def test_check_mode_load_reports_a_change_and_loads_nothing(playbook_run, worker_dockerd, busybox_image, tmp_path):
    worker_dockerd.docker("rmi", "-f", busybox_image[1])
    cache_dir = os.path.dirname(playbook_run["first_publish"]["entry"])

    _, result = run_module(
        tmp_path,
        {"state": "loaded", "image_id": busybox_image[1], "cache_dir": cache_dir},
        "--check",
        DOCKER_HOST=worker_dockerd.host,
    )

    assert (result["action_taken"], result["changed"]) == ("loaded", True)
    assert image_id(busybox_image[1], host=worker_dockerd.host) is None


def test_check_mode_publish_creates_no_cache_dir(private_dockerd, busybox_image, tmp_path):
    cache_dir = tmp_path / "not-yet"

    _, result = run_module(
        tmp_path,
        {"state": "published", "image": busybox_image[0], "cache_dir": str(cache_dir)},
        "--check",
        DOCKER_HOST=private_dockerd.host,
    )

    assert (result["action_taken"], result["changed"]) == ("saved", True)
    assert not cache_dir.exists()


def test_a_world_writable_cache_dir_fails_the_task_with_the_fix(private_dockerd, busybox_image, tmp_path):
    cache_dir = tmp_path / "open-to-all"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)

    returncode, result = run_module(
        tmp_path,
        {"state": "published", "image": busybox_image[0], "cache_dir": str(cache_dir)},
        DOCKER_HOST=private_dockerd.host,
    )

    assert returncode != 0
    assert f"chmod go-w {cache_dir}" in result["msg"]
    assert "exception" not in result


def test_MAD_DOCKER_BUILDS_overrides_the_cache_dir_option(tmp_path):
    from_env = tmp_path / "from-env"
    from_env.mkdir(mode=0o755)

    _, result = run_module(
        tmp_path, {"state": "pruned", "cache_dir": str(tmp_path / "from-option")}, MAD_DOCKER_BUILDS=str(from_env)
    )

    assert result["cache_dir"] == str(from_env)
