"""Preflight under Charliecloud, for real on this machine as an ordinary user not in the docker group: the docker
check becomes the runtime's, a node whose ch-run is missing gets a problem naming the fix, and each node says whether
it runs the image in place or must unpack it (a node without FUSE: /dev/fuse hidden in its own mount namespace)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support.ansible import ROOT
from tests.support.users.local_users import NODOCKER, SYSTEM_PYTHON, TEAM, ensure_user, setpriv_argv

MODULE = "ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.preflight"


def _hiding(*paths: str) -> list:
    """Run as root in a private mount namespace where each of `paths` is /dev/null."""
    binds = " && ".join(f"mount --bind /dev/null {path}" for path in paths)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{binds} && exec "$@"', "-"]


def preflight_as_user(settings: dict, prefix=()) -> dict:
    if shutil.which("ch-run", path="/usr/bin") is None:
        pytest.skip("needs Charliecloud (ch-run)")
    ensure_user(NODOCKER, groups=(TEAM,))
    argv = ["env", f"PYTHONPATH={ROOT / 'collections'}", "PATH=/usr/bin:/bin", SYSTEM_PYTHON, "-m", MODULE]
    argv += ["--json", json.dumps(dict({"container_runtime": "charliecloud", "node": "node9"}, **settings))]
    ran = subprocess.run([*prefix, *setpriv_argv(NODOCKER, argv)], capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip(), ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


CHECKS = ["docker", "disk", "stale_gpu_containers"]


def test_a_healthy_node_runs_the_image_in_place_and_asks_no_docker_daemon():
    result = preflight_as_user({"checks": CHECKS})
    assert result["problems"] == [], result
    assert result["image_access"] == "in-place"
    assert not any("docker" in note.lower() for note in result["notes"]), result["notes"]


def test_a_node_without_ch_run_is_refused_naming_the_fix():
    result = preflight_as_user({"checks": CHECKS}, prefix=_hiding("/usr/bin/ch-run"))
    (problem,) = [p for p in result["problems"] if "ch-run" in p["problem"]]
    assert "not installed on node9" in problem["problem"]
    assert "install Charliecloud on node9" in problem["fix"] and "--exclude node9" in problem["fix"]


def test_a_node_without_fuse_says_it_must_unpack():
    result = preflight_as_user({"checks": CHECKS}, prefix=_hiding("/dev/fuse"))
    assert result["image_access"] == "unpack"
    assert any("must unpack the image once" in note for note in result["notes"]), result["notes"]


def test_an_unknown_runtime_is_refused_naming_the_choices():
    result = subprocess.run(
        [SYSTEM_PYTHON, "-m", MODULE, "--json", json.dumps({"container_runtime": "podman"})],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "collections")},
    )  # fmt: skip
    assert result.returncode == 2 and "docker, charliecloud" in result.stderr
