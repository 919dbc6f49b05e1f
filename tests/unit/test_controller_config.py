"""ansible.cfg as Ansible itself reads it from the checkout: the settings the pipeline's cost depends on."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _changed_settings() -> dict:
    dumped = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-config"), "dump", "--only-changed", "--type", "base"],
        cwd=ROOT,
        env=dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg")),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    settings = {}
    for line in dumped.splitlines():
        name, _, value = line.partition("=")
        settings[name.split("(")[0].strip()] = value.strip()
    return settings


def test_the_batch_host_gathers_no_facts_and_cleans_none_per_host_and_task():
    settings = _changed_settings()
    assert settings["DEFAULT_GATHERING"] == "explicit"
    assert settings["INJECT_FACTS_AS_VARS"] == "False"
    assert settings["ANSIBLE_PIPELINING"] == "True"
