"""A sweep's later model runs the real run_multi.yml from the sweep's manifest: image k, card k, its own job ID.

Check mode on two simulated nodes (as benchmarks/scale_bench.py does: the real slurm_allocation inventory over a
faked allocation, the local connection, a docker stub that answers only the read-only calls check mode makes). The
run builds nothing and starts no container; what it shows is what the build stage handed on (node_image) and where
the run's files go. On main the build stage refuses the two-model manifest ("narrow the tags").
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    BuildOutcome,
    plan_image_builds,
    record_builds,
    with_base_images,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_model_cards,
    select_model_cards,
    write_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL

ROOT = Path(__file__).resolve().parents[4]
BIN = Path(sys.executable).parent
IMAGE_ID = "sha256:" + "5c" * 32
DOCKER_STUB = """#!/bin/sh
case "$1 $2" in
  "version "*) echo 20.10.24 ;;
  "info "*) echo /tmp ;;
  "ps "*) ;;
  "image inspect") exec cat "$SWEEP_TEST_IMAGE_JSON" ;;
  *) echo "docker stub: check mode should not run docker $*" >&2; exit 97 ;;
esac
"""


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_sweeps_second_model_runs_its_own_image_and_card_from_the_sweeps_manifest(tmp_path, mode):
    results = tmp_path / "results"
    attempt = results / "990002" / "attempt-0"
    attempt.mkdir(parents=True, mode=0o755)
    models = ROOT / "models" / "models.json"
    context = {"guest_os": "UBUNTU", "docker_build_arg": {}, "docker_env_vars": {}, "docker_mounts": {}}
    cards = select_model_cards(load_model_cards(models), ["dummy", "dummy_lastrank"])
    plans = plan_image_builds(models.parent, cards, context, attempt)
    # The docker stub answers every `image inspect` with IMAGE_ID, the base image's included.
    plans = [with_base_images(plan, {reference: IMAGE_ID for reference in plan.base_references}) for plan in plans]
    outcomes = [BuildOutcome(plan, "reused", IMAGE_ID, 0.0, "on every node") for plan in plans]
    manifest = attempt / "build_manifest.json"
    write_manifest(str(manifest), record_builds(outcomes, context))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(DOCKER_STUB)
    (bin_dir / "docker").chmod(0o755)
    image_json = tmp_path / "image.json"
    labels = {FINGERPRINT_LABEL: plans[1].fingerprint}
    image_json.write_text(json.dumps([{"Id": IMAGE_ID, "Size": 1, "Config": {"Labels": labels}}]))
    (tmp_path / "no-site.yml").touch()  # an empty site file: none of the lab's settings
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MAD_", "ANSIBLE_"))}
    env.update(
        PATH=f"{bin_dir}:{BIN}:{env.get('PATH', '')}",
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        SLURM_JOB_ID="990002",
        SLURM_JOB_NODELIST="sim[1-2]",
        SLURM_JOB_NUM_NODES="2",
        MASTER_ADDR="127.0.0.1",
        SLURM_MULTI_JOB_END="NONE",
        SLURM_MULTI_SITE_CONFIG=str(tmp_path / "no-site.yml"),
        SWEEP_TEST_IMAGE_JSON=str(image_json),
        SLURMD_NODENAME="sim1",
        MAD_BARRIER_TOKEN="t" * 32,
        SLURM_MULTI_RUN_NONCE="n" * 32,  # what the pull step gives its nodes
    )
    run_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "results_dir": str(results),
        "image_cache_dir": str(tmp_path / "cache"),
        "model_tags": ["dummy", "dummy_lastrank"],
        "postprocessing_fail_on_failure": False,
        "mode": mode,
        # What slurm_multi/submission/sweep.py gives the second model's run.
        "job_id": "990002.2",
        "sweep_manifest": str(manifest),
        "sweep_index": 1,
        "manifest_path": str(manifest),
    }
    argv = [str(BIN / "ansible-playbook"), str(ROOT / "playbooks" / "run_multi.yml"), "--check", "-f", "2", "-v"]
    if mode == "pull":
        argv += ["--limit", "sim1"]
    completed = subprocess.run(
        [*argv, "-e", json.dumps(run_vars)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    output = completed.stdout + completed.stderr
    assert "narrow the tags" not in output and "FAILED!" not in output, output[-6000:]
    assert completed.returncode == 0, output[-6000:]
    # The run's files go under the model's own job ID, and it ran the second image with its card.
    assert (results / "990002.2" / "attempt-0" / "nodes" / "sim1").is_dir()
    assert re.search(r"model: dummy_lastrank\b", output) or '"model": "dummy_lastrank"' in output, output[-6000:]
    assert plans[1].image_name in output and plans[0].image_name not in output.split("Run the model")[-1]
