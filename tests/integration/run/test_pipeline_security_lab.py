"""Secrets and user data through the whole pipeline (real ansible-playbook on the 3-node lab): the container gets
them, nothing else does; ordinary environment values are data and stay intact (the figure of the perf line too).
"""

import csv
import hashlib
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import ENV_FILE_PREFIX
from tests.support.ansible import ROOT, ansible_env
from tests.support.container_command import argv_matches, recorded_argv, without_node_gpu_variables
from tests.support.lab.per_mode_jobs import both_modes_at_once
from tests.support.lab.pipeline import run_pipeline

pytestmark = pytest.mark.lab

# Every rank shows what it was given; the last one prints the figure, as Primus/Megatron do.
PROBE = """#!/bin/sh
. "$(dirname "$0")/common.sh"
printf 'secret-md5 %s\\n' "$(printf %s "$MAD_SECRETS_HFTOKEN" | md5sum | cut -d' ' -f1)"
printf 'hf-token-md5 %s\\n' "$(printf %s "$HF_TOKEN" | md5sum | cut -d' ' -f1)"
echo "secret as printed: $MAD_SECRETS_HFTOKEN"
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG"
for arg in "$@"; do printf 'arg [%s]\\n' "$arg"; done
if [ "$NODE_RANK" -eq "$LAST_RANK" ]; then echo "performance: 4200 tok/s"; fi
"""


CONTEXT = {
    "docker_env_vars": {
        "MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}",
        "HF_TOKEN": "${MAD_SECRETS_HFTOKEN}",
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
    }
}


def _zoo_with_probe(tmp_path: Path, args: str) -> Path:
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "scripts" / "dummy" / "run_probe.sh").write_text(PROBE)
    cards = json.loads((zoo / "models.json").read_text())
    probe = dict(cards[0], name="secret_probe", scripts="scripts/dummy/run_probe.sh", args=args, tags=["probe"])
    (zoo / "models.json").write_text(json.dumps(cards + [probe]))
    return zoo / "models.json"


def _on_every_node(script: str) -> str:
    """The output of a shell script run on every lab node (docker of that node)."""
    result = subprocess.run(["srun", "-N3", "--quiet", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def files_holding(secret: str, *roots: Path) -> list:
    """Every file under ``roots`` whose bytes hold ``secret`` (binary files too: a tar, a pickled artifact)."""
    needle = secret.encode()
    return [
        str(path)
        for root in roots
        for path in Path(root).rglob("*")
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes()
    ]


def docker_state_holding(secret: str) -> list:
    """Where the nodes' Docker state holds ``secret``: `docker inspect` of every container left (the job's own
    are removed: while they run, `docker inspect` shows their environment, which is Docker's boundary), `docker
    image inspect` and `docker history --no-trunc` of every image, on every node."""
    inspected = _on_every_node(
        'for c in $(docker ps -a -q); do docker inspect "$c"; done; '
        'for i in $(docker image ls -q | sort -u); do docker image inspect "$i"; docker history --no-trunc "$i"; done'
    )
    return [line.strip()[:200] for line in inspected.splitlines() if secret in line]


@pytest.fixture(scope="module")
def secured_run(lab_cluster, tmp_path_factory):
    """mode -> one 3-node run of the probe with a secret in the secrets file, ordinary env vars and hostile model
    args: (run, secret, marker, logs); both modes' runs side by side, each with a secret of its own."""

    def run_probe(mode):
        tmp_path = tmp_path_factory.mktemp(f"secured-run-{mode}")
        secret = f"hf_{uuid.uuid4().hex}"
        secrets_file = tmp_path / "secrets.env"
        secrets_file.write_text(f"MAD_SECRETS_HFTOKEN={secret}\n")
        secrets_file.chmod(0o600)
        marker = tmp_path / "pwned"
        args = f"--name '{{{{ lookup(\"pipe\", \"id\") }}}}' --cmd '$(touch {marker})' '`touch {marker}`;'"
        run = run_pipeline(
            tmp_path / "results",
            mode=mode,
            nodelist="node[1-3]",
            models_file=str(_zoo_with_probe(tmp_path, args)),
            model_tags=["secret_probe"],
            secrets_file=str(secrets_file),
            # An old manifest's placeholder must not clobber the real value (the HF 401 bug); HF_TOKEN gets it too.
            additional_context=CONTEXT,
            env=ansible_env(MAD_SECRETS_HFTOKEN=secret),
        )
        assert run.rc == 0, run.output[-3000:]
        logs = {
            node: next(run.results_dir.rglob(f"nodes/{node}/run.log")).read_text()
            for node in ("node1", "node2", "node3")
        }
        return run, secret, marker, logs

    return both_modes_at_once(run_probe, output=lambda made: made[0].output)


def test_ordinary_env_vars_reach_the_container_and_the_record_holds_the_exact_figure(secured_run, pipeline_mode):
    # The masking bug: OMP_NUM_THREADS=4 masked every "4": "performance: ********200 tok/s", FAILURE "no metric".
    run, _, _, logs = secured_run(pipeline_mode)
    assert all("OMP_NUM_THREADS=4 NCCL_DEBUG=INFO" in log for log in logs.values()), logs
    assert "performance: 4200 tok/s" in logs["node3"]
    assert run.record["status"] == "SUCCESS", run.record.get("reason")
    assert [(row["performance"], row["metric"]) for row in run.record["rows"]] == [("4200", "tok/s")]
    with open(run.results_dir / "perf.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["model"], r["performance"], r["metric"], r["status"]) for r in rows] == [
        ("secret_probe", "4200", "tok/s", "SUCCESS")
    ]


def test_the_secret_reaches_the_container_under_its_name_and_a_placeholder(secured_run, pipeline_mode):
    _, secret, _, logs = secured_run(pipeline_mode)
    digest = hashlib.md5(secret.encode()).hexdigest()
    assert f"secret-md5 {digest}" in logs["node2"] and f"hf-token-md5 {digest}" in logs["node2"]
    assert "secret as printed: ********" in logs["node2"]


def test_user_data_stays_literal_no_jinja_no_shell(secured_run, pipeline_mode):
    _, _, marker, logs = secured_run(pipeline_mode)
    assert 'arg [{{ lookup("pipe", "id") }}]' in logs["node1"]
    assert f"arg [$(touch {marker})]" in logs["node1"]
    assert not marker.exists()


def test_the_secret_is_in_no_output_file_docker_object_or_ansible_output(secured_run, pipeline_mode):
    run, secret, _, _ = secured_run(pipeline_mode)
    assert secret not in run.output
    assert files_holding(secret, run.results_dir) == []
    assert docker_state_holding(secret) == []
    job_containers = _on_every_node(f"docker ps -a -q --filter label=slurm-multi.job={run.job_dir.name}")
    assert job_containers.split() == []


def test_the_dry_runs_container_command_is_the_one_each_nodes_run_log_records(secured_run, pipeline_mode):
    run, secret, _, logs = secured_run(pipeline_mode)
    dry_run = subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", "submit", "--dry-run", "-N", "3", "--nodelist", "node[1-3]"]
        + ["--tags", "secret_probe", "--models-file", str(run.results_dir.parent / "zoo" / "models.json")]
        + ["--results-dir", str(run.results_dir), "-c", json.dumps(CONTEXT)],
        cwd=ROOT,
        env=ansible_env(MAD_SECRETS_HFTOKEN=secret),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry_run.returncode == 0, dry_run.stderr[-2000:]
    assert secret not in dry_run.stdout
    planned = dry_run.stdout.split("# node1 (rank 0):\n", 1)[1]
    for rank, node in enumerate(("node1", "node2", "node3")):
        ours, planned = planned.split(f"# node{rank + 2} (rank {rank + 1}):\n", 1) if rank < 2 else (planned, "")
        ran = without_node_gpu_variables(recorded_argv(logs[node]))
        assert ran and argv_matches(recorded_argv(ours), ran), (node, recorded_argv(ours), ran)
        # The env file's variables, values and masks alike, are the same lines.
        env_file_lines = [line for line in ours.splitlines() if line.startswith(ENV_FILE_PREFIX)]
        assert "slurm-multi: container env file: HF_TOKEN=********" in env_file_lines
        assert env_file_lines == [line for line in logs[node].splitlines() if line.startswith(ENV_FILE_PREFIX)]
