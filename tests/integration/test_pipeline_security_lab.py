"""Secrets and user data through the whole pipeline: the container gets them, nothing else does."""

import hashlib
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.ansible import ROOT, ansible_env
from tests.support.pipeline import run_pipeline

pytestmark = pytest.mark.lab

PROBE = """#!/bin/sh
. "$(dirname "$0")/common.sh"
printf 'secret-md5 %s\\n' "$(printf %s "$MAD_SECRETS_HFTOKEN" | md5sum | cut -d' ' -f1)"
for arg in "$@"; do printf 'arg [%s]\\n' "$arg"; done
echo "performance: 7 samples_per_second"
"""


def _zoo_with_probe(tmp_path: Path, args: str) -> Path:
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "scripts" / "dummy" / "run_probe.sh").write_text(PROBE)
    cards = json.loads((zoo / "models.json").read_text())
    probe = dict(cards[0], name="secret_probe", scripts="scripts/dummy/run_probe.sh", args=args, tags=["probe"])
    (zoo / "models.json").write_text(json.dumps(cards + [probe]))
    return zoo / "models.json"


def _all_outputs(run) -> str:
    texts = [run.output]
    for path in run.results_dir.rglob("*"):
        if path.is_file():
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def test_secret_reaches_the_container_and_nothing_else(lab_cluster, tmp_path):
    secret = f"hf_{uuid.uuid4().hex}"
    secrets_file = tmp_path / "secrets.env"
    secrets_file.write_text(f"MAD_SECRETS_HFTOKEN={secret}\n")
    secrets_file.chmod(0o600)
    marker = tmp_path / "pwned"
    args = f"--name '{{{{ lookup(\"pipe\", \"id\") }}}}' --cmd '$(touch {marker})' '`touch {marker}`;'"
    run = run_pipeline(
        tmp_path / "results", models_file=str(_zoo_with_probe(tmp_path, args)), model_tags=["secret_probe"],
        secrets_file=str(secrets_file),
        # An old manifest's placeholder must not clobber the real value (the HF 401 bug).
        additional_context={"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}"}},
        env=ansible_env(MAD_SECRETS_HFTOKEN=secret))
    assert run.rc == 0, run.output[-3000:]
    log = (run.job_dir / "nodes" / "node2" / "run.log").read_text()
    assert f"secret-md5 {hashlib.md5(secret.encode()).hexdigest()}" in log
    # User data stays literal: no Jinja on the controller, no shell anywhere.
    assert "arg [{{ lookup(\"pipe\", \"id\") }}]" in log
    assert f"arg [$(touch {marker})]" in log
    assert not marker.exists()
    assert secret not in _all_outputs(run)
    inspect = subprocess.run(["srun", "-N3", "--quiet", "docker", "ps", "-a", "-q"], capture_output=True, text=True)
    assert secret not in inspect.stdout
