"""Every role's molecule scenario passes: `molecule test` converges it on this machine and verifies the real state.

Each scenario runs localhost as a one-node allocation against a Docker daemon of this session's own (the
`private_dockerd` fixture), holding the base image the sample models build FROM, so the lab is not needed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

ROLES_WITH_SCENARIOS = ["node_play_guards", "preflight", "preparation", "build", "running", "postprocessing"]
# The sample models' Dockerfile builds FROM the lab's base image; the private daemon gets the same name.
LAB_BASE_IMAGE = "slurm-multi-lab/busybox:latest"


@pytest.fixture(scope="module")
def molecule_env(private_dockerd, busybox_image):
    """Molecule's environment: the venv's tools first on PATH, the private daemon as DOCKER_HOST, no colours."""
    tag, _ = busybox_image
    private_dockerd.docker("tag", tag, LAB_BASE_IMAGE)
    env = dict(private_dockerd.env)
    # molecule runs ansible-config and ansible-playbook by name: they must be this venv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(NO_COLOR="1", PY_COLORS="0", ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    return env


def run_molecule(role_dir: Path, env: dict) -> subprocess.CompletedProcess:
    """`molecule test -s default` in a role's directory."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "molecule"), "test", "-s", "default"],
        cwd=role_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize("role", ROLES_WITH_SCENARIOS)
def test_role_scenario_converges_and_verifies(role, molecule_env):
    result = run_molecule(ROOT / "roles" / role, molecule_env)
    # molecule colours its own log lines even without a terminal.
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    assert result.returncode == 0, f"molecule test of role {role} failed:\n{output[-6000:]}"
    # A missing verify.yml is only a warning to molecule: the verification must really have run.
    assert "verify: Executed: Successful" in output, f"role {role}'s verify step did not run:\n{output[-3000:]}"
