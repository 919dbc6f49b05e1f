"""The built collection, installed outside the checkout, runs the lab job by its full name:
`ansible-playbook slurm_multi.pipeline.run_multi` in a 2-node allocation, from a directory of the user's holding the
ansible.cfg of the collection's README and a copy of its inventory/slurm.yml, in a Python without the slurm_multi
package (the collection alone is the pipeline; README, "What the controller and the nodes need")."""

import json
import shutil
import subprocess

import pytest

from tests.support.ansible import ROOT
from tests.support.collection import (
    install_built_collection,
    python_without_the_package,
    readme_ansible_cfg,
    user_env,
)

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]


def test_the_installed_collection_runs_the_lab_job_by_its_full_name(lab_cluster, tmp_path):
    installed = install_built_collection(tmp_path)
    user = tmp_path / "user"
    user.mkdir()
    (user / "ansible.cfg").write_text(readme_ansible_cfg())
    shutil.copy(installed.root / "inventory" / "slurm.yml", user / "slurm.yml")
    python = python_without_the_package(tmp_path / "venv")
    results = tmp_path / "results"
    results.mkdir(mode=0o755)
    extra_vars = {"results_dir": str(results), "model_tags": ["dummy_lastrank"]}
    ran = subprocess.run(
        ["salloc", "-N", "2", "--quiet", python, "-m", "ansible.cli.playbook", "slurm_multi.pipeline.run_multi"]
        + ["-f", "2", "-e", json.dumps(extra_vars)],
        cwd=user,
        # The preload callback's kept payloads and templates: this test's, not the suite user's cache.
        env=user_env(installed.collections_path, XDG_CACHE_HOME=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-4000:]
    (record_file,) = (results / "records").glob("*.json")
    record = json.loads(record_file.read_text())
    assert record["status"] == "SUCCESS", record
    assert [(row["model"], row["performance"], row["nnodes"]) for row in record["rows"]] == [
        ("dummy_lastrank", "1.0123e+04", "2")
    ]
    # The installed collection's roles ran, none of the checkout's (the venv, which may live in the checkout, is
    # Ansible's own and may be named in a warning).
    assert "TASK [slurm_multi.pipeline.running : " in output, output[-4000:]
    for folder in ("roles", "playbooks", "library", "plugins", "module_utils"):
        assert str(ROOT / folder) not in output, output[-4000:]
