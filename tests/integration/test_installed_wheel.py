"""An installed wheel carries the Ansible content: `slurm-multi submit --dry-run` works from any directory.

The wheel is built offline from a copy of the checkout (nothing is written into the checkout) and installed
without dependencies into a fresh venv; the project venv's site-packages provide the dependencies.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = (".git", ".venv", ".pytest_cache", "__pycache__", "*.egg-info", "tests", "benchmarks", "dist")


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory):
    """A venv with the slurm-multi wheel installed (no dependencies); returns its path."""
    if not (ROOT / "README.md").is_file():
        pytest.skip("README.md, pyproject's readme, is missing: no wheel can be built")
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    shutil.rmtree(source / "build", ignore_errors=True)  # a stale setuptools build dir, never roles/build
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(base / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (base / "dist").glob("slurm_multi-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return venv


def _installed_content(venv: Path) -> Path:
    site_packages = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    return Path(site_packages) / "slurm_multi" / "ansible_content"


def test_the_wheel_ships_the_playbooks_roles_modules_and_config(installed_venv):
    content = _installed_content(installed_venv)
    for path in (
        "ansible.cfg",
        "playbooks/run_multi.yml",
        "playbooks/collect.yml",
        "playbooks/group_vars/all.yml",
        "roles/build/tasks/main.yml",
        "library/run_model.py",
        "module_utils/results/collection.py",
        "plugins/inventory/slurm_allocation.py",
        # The roles call the filters by their full name: the collection's skeleton carries them.
        "collections/ansible_collections/slurm_multi/pipeline/plugins/filter/job_layout.py",
        "inventory/slurm.yml",
        "models/models.json",
    ):
        assert (content / path).is_file(), path


def test_the_wheel_installs_the_speedup_layer_and_its_scripts_beside_the_venvs_python(installed_venv):
    package = _installed_content(installed_venv).parent / "speedup"
    assert (package / "module_server.py").is_file() and (package / "switch.py").is_file()
    for script in ("slurm-multi-module-python", "slurm-multi-module-client", "slurm-multi-playbook"):
        assert os.access(installed_venv / "bin" / script, os.X_OK), script


def test_an_installed_submit_dry_run_uses_the_installed_content_from_another_directory(installed_venv, tmp_path):
    # The dependencies (ansible-playbook included) come from the project's venv.
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        PYTHONPATH=sysconfig.get_paths()["purelib"],
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("SLURM_MULTI_HOME", None)
    result = subprocess.run(
        [str(installed_venv / "bin" / "slurm-multi"), "submit", "--dry-run", "-N", "2", "--tags", "dummy"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    content = _installed_content(installed_venv)
    assert f"export ANSIBLE_CONFIG={content}/ansible.cfg" in result.stdout
    assert f"PLAYBOOKS={content}/playbooks" in result.stdout
    assert f"{ROOT}/playbooks" not in result.stdout and f"{ROOT}/ansible.cfg" not in result.stdout
