"""The model_scripts module as Ansible runs it (`ansible localhost -m model_scripts`, local connection)."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPTS = ROOT / "models" / "scripts" / "dummy"


def run_module(tmp_path, module_args, *options):
    """(exit code, the module's result as the tree callback records it) of one `ansible localhost -m model_scripts`."""
    tree = tmp_path / f"tree-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
        ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree",
        ANSIBLE_CALLBACK_TREE_DIR=str(tree),
    )
    completed = subprocess.run(
        [
            str(BIN / "ansible"),
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-m",
            "model_scripts",
            "-a",
            json.dumps(module_args),
            *options,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (tree / "localhost").exists(), completed.stdout + completed.stderr
    return completed.returncode, json.loads((tree / "localhost").read_text())


def test_the_module_copies_the_scripts_directory_into_every_workspace(tmp_path):
    workspaces = [str(tmp_path / node / "workspace") for node in ("node1", "node2", "node3")]
    returncode, result = run_module(tmp_path, {"scripts": str(SCRIPTS / "run_lastrank.sh"), "workspaces": workspaces})
    assert returncode == 0, result
    assert (result["changed"], result["script"], result["source"]) == (True, "run_lastrank.sh", str(SCRIPTS))
    for workspace in workspaces:
        assert sorted(os.listdir(workspace)) == sorted(os.listdir(SCRIPTS))


def test_check_mode_reports_the_copy_and_copies_nothing(tmp_path):
    workspace = tmp_path / "node1" / "workspace"
    returncode, result = run_module(tmp_path, {"scripts": str(SCRIPTS), "workspaces": [str(workspace)]}, "--check")
    assert returncode == 0, result
    assert (result["changed"], result["script"], result["workspaces"]) == (True, "run.sh", [str(workspace)])
    assert not workspace.exists()


def test_missing_scripts_fail_the_task_naming_them(tmp_path):
    returncode, result = run_module(
        tmp_path, {"scripts": str(SCRIPTS / "nope.sh"), "workspaces": [str(tmp_path / "ws")]}
    )
    assert returncode != 0, result
    assert "nope.sh do not exist" in result["msg"] and "`scripts`" in result["msg"]
