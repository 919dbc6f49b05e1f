"""Real distributed workloads on the 3-node lab, through MAD's launcher contract, in both modes.

* pyt_ddp_tiny: a small transformer trained with DDP over gloo by torchrun, started as MAD's scripts start it
  (`$MAD_MULTI_NODE_RUNNER train_ddp.py`), from a 1.2 GB PyTorch base (Debian bookworm, the torch 2.13.0 CPU
  wheel; slurm_multi/lab/pytorch.py). The workers lack the base and the model's image before each run: the image
  reaches them through the default transport (the shared tar cache).
* dummy_disagg: SGLang's disaggregated-serving shape on busybox: rank 0's proxy reaches a server on every other
  rank through SGLANG_NODE_IPS.
* mad_bash_dummy (tests/fixtures/mad_bash_zoo): madengine's dummy card's shape on the same Debian base, whose
  /bin/sh is dash: its run.sh uses bash's own features ($RANDOM, arrays, [[ ]], source, pipefail) and prints a
  figure only when run with bash, as madengine runs a .sh script. One node (node1, which holds the base).

One job per model and mode, read by every test here; a mode's jobs run side by side, two at a time (their own
results dirs, job IDs and ports), the modes one after the other (each torch run first removes the image from the
workers).
"""

import csv
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from slurm_multi.lab.pytorch import PYTORCH_BASE, ensure_pytorch_base, remove_pytorch_base
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.per_mode_jobs import MODES, in_mode, side_by_side
from tests.support.lab.pipeline import run_pipeline

pytestmark = pytest.mark.lab

NODES = ("node1", "node2", "node3")
WORKERS = ("node2", "node3")
TORCH_MODEL = "pyt_ddp_tiny"
BASH_MODEL = "mad_bash_dummy"
BASH_ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "mad_bash_zoo"


def _docker(node, *args):
    env = dict(os.environ, DOCKER_HOST=node_docker_host(node))
    return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=300)


def _remove_model_images(node):
    listed = _docker(node, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    for image in listed:
        if image.startswith(f"ci-{TORCH_MODEL}"):
            _docker(node, "rmi", "-f", image)


@pytest.fixture(scope="module")
def workloads(lab_cluster, tmp_path_factory):
    """(model, mode) -> its run."""
    for node in ensure_pytorch_base(["node1"]):
        _remove_model_images(node)  # built on an older base

    def run(model, mode):
        if model == TORCH_MODEL:
            for worker in WORKERS:
                _remove_model_images(worker)
            remove_pytorch_base(WORKERS)
        results = tmp_path_factory.mktemp(f"workload-{model}-{mode}") / "results"
        if model == BASH_MODEL:
            started = time.monotonic()
            job = run_pipeline(
                results,
                nodes=1,
                mode=mode,
                nodelist="node1",
                model_tags=[model],
                models_file=str(BASH_ZOO / "models.json"),
            )
            print(f"{BASH_MODEL} [{mode}]: {time.monotonic() - started:.1f} s")
            return job
        return run_pipeline(results, mode=mode, nodelist="node[1-3]", model_tags=[model])

    made = {}
    for mode in MODES:
        # The torch job first: the short ones share the other thread, one after the other.
        models = (TORCH_MODEL, "dummy_disagg", BASH_MODEL)
        made.update(side_by_side({(model, mode): (lambda m=model, md=mode: run(m, md)) for model in models}))
    return made


def _run_of(workloads, model, mode):
    run = workloads[model, mode]
    return in_mode(run, mode, run.output)


def _rows(run):
    with open(run.results_dir / "perf.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _log(run, node):
    return (run.attempt_dir / "nodes" / node / "run.log").read_text()


def _every_log_tail(run):
    """What each node's model printed last: the Ansible output names a failing rank, the log says why."""
    tails = []
    for node in NODES:
        path = run.attempt_dir / "nodes" / node / "run.log"
        tails.append(f"--- {node} run.log ---\n" + (path.read_text()[-2000:] if path.exists() else "(none)"))
    return "\n".join(tails)


def test_the_pytorch_job_trains_across_three_nodes_and_the_last_rank_reports_tokens_per_second(
    workloads, pipeline_mode
):
    run = _run_of(workloads, TORCH_MODEL, pipeline_mode)
    assert run.rc == 0, run.output[-3000:] + "\n" + _every_log_tail(run)
    (row,) = _rows(run)
    assert (row["model"], row["metric"], row["status"], row["launcher"]) == (
        TORCH_MODEL,
        "tokens/sec",
        "SUCCESS",
        "torchrun",
    )
    assert float(row["performance"]) > 0
    for rank, node in enumerate(NODES):
        log = _log(run, node)
        assert f"rank {rank}/3 joined" in log and "weights agree across 3 ranks" in log, log[-2000:]
        assert ("performance:" in log) == (node == "node3")


def test_the_pytorch_row_says_which_image_ran_and_the_record_holds_every_nodes_image_id(workloads, pipeline_mode):
    run = _run_of(workloads, TORCH_MODEL, pipeline_mode)
    (row,) = _rows(run)
    assert row["docker_image"].startswith(f"ci-{TORCH_MODEL}") and row["base_docker"] == PYTORCH_BASE
    assert float(row["build_duration"]) >= 0 and len(row["git_commit"]) == 40
    record = run.record
    image_ids = {entry["image_id"] for entry in record["per_node"].values()}
    assert len(image_ids) == 1 and next(iter(image_ids)).startswith("sha256:")
    assert all(entry["hostname"] for entry in record["per_node"].values())


def test_the_workers_got_the_pytorch_image_through_the_tar_cache(workloads, pipeline_mode):
    run = _run_of(workloads, TORCH_MODEL, pipeline_mode)
    timeline = run.record["timeline"]
    assert all("load" in timeline[worker] for worker in WORKERS), json.dumps(timeline)


def test_the_disaggregated_proxy_reaches_a_server_on_every_other_rank(workloads, pipeline_mode):
    run = _run_of(workloads, "dummy_disagg", pipeline_mode)
    assert run.rc == 0, run.output[-4000:]
    (row,) = _rows(run)
    assert (row["performance"], row["metric"], row["status"], row["launcher"]) == (
        "2",
        "servers_answered",
        "SUCCESS",
        "sglang-disagg",
    )
    proxy = _log(run, "node1")
    assert "rank 1 answered: prefill server rank 1 at 127.0.0.12" in proxy
    assert "rank 2 answered: decode server rank 2 at 127.0.0.13" in proxy
    assert all("proxy done: stopping" in _log(run, worker) for worker in WORKERS)


def test_a_mad_sh_script_runs_under_bash_on_a_debian_base_whose_sh_is_dash(workloads, pipeline_mode):
    run = _run_of(workloads, BASH_MODEL, pipeline_mode)
    assert run.rc == 0, run.output[-3000:]
    (row,) = _rows(run)
    assert (row["model"], row["metric"], row["status"]) == (BASH_MODEL, "samples_per_second", "SUCCESS")
    assert int(row["performance"]) > 0
    # The container's own output: run.log's head is the container's command, whose sh fallback names "has no bash".
    log = "\n".join(line for line in _log(run, "node1").splitlines() if not line.startswith("slurm-multi: container"))
    assert "args: <--label> <two words>" in log and "shell: bash 5." in log and "has no bash" not in log, log
    # What makes it a test of the shell: the base's own sh is dash, under which the script fails.
    sh = _docker("node1", "run", "--rm", "--network=host", PYTORCH_BASE, "readlink", "-f", "/bin/sh")
    assert sh.stdout.strip() == "/usr/bin/dash", sh.stdout + sh.stderr
