"""The hang watchdog on the 3-node lab: real torchrun jobs over gloo that hang, and one that only looks like it.

tests/fixtures/hang_zoo's models, on the lab's PyTorch base, with hang_timeout at 5 s:
* hang_allreduce: rank 2 sleeps in its data loader while ranks 0 and 1 wait in all_reduce;
* hang_init: rank 2 never calls init_process_group; ranks 0 and 1 wait in it;
* quiet_busy: rank 2 computes for 20 s printing nothing while the others wait; then the job succeeds. While it
  computes, `slurm-multi stacks` takes every rank's stacks.

One job per model, all three at once, each read by several tests. Push mode only: the watchdog lives in the run
module, which both modes run alike on every node.
"""

import subprocess
import threading
import time
from pathlib import Path

import pytest

from slurm_multi.lab.pytorch import ensure_pytorch_base
from tests.support.ansible import BIN
from tests.support.lab.per_mode_jobs import side_by_side
from tests.support.lab.pipeline import run_pipeline

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2", "node3")
ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "hang_zoo"
HANG_TIMEOUT = 5
BUSY_SECONDS = 20  # quiet_busy's args: four times the timeout
MODELS = ("hang_allreduce", "hang_init", "quiet_busy")


@pytest.fixture(scope="module")
def hang_jobs(lab_cluster, tmp_path_factory):
    """model -> its job's run."""
    ensure_pytorch_base(NODES)  # the model's image is its base: nothing to move but a label

    def run(model):
        results = tmp_path_factory.mktemp(f"hang-{model}") / "results"
        if model == "quiet_busy":
            threading.Thread(target=_stacks_while_rank_2_computes, args=(results,), daemon=True).start()
        return run_pipeline(
            results,
            mode="push",
            nodelist="node[1-3]",
            model_tags=[model],
            models_file=str(ZOO / "models.json"),
            hang_timeout=HANG_TIMEOUT,
        )

    return side_by_side({model: (lambda model=model: run(model)) for model in MODELS}, at_once=len(MODELS))


ON_DEMAND = {}


def _stacks_while_rank_2_computes(results: Path) -> None:
    """`slurm-multi stacks JOB` once quiet_busy's rank 2 joined (it then computes for BUSY_SECONDS)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        logs = list(results.glob("*/attempt-0/nodes/node3/run.log"))
        if logs and "rank 2 joined" in logs[0].read_text():
            job_id = logs[0].parents[3].name
            ON_DEMAND["job"] = job_id
            ON_DEMAND["run"] = subprocess.run(
                [BIN / "slurm-multi", "stacks", job_id, "--results-dir", str(results)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            return
        time.sleep(0.5)


def _stacks(job, node) -> str:
    return (job.attempt_dir / "nodes" / node / "stacks.txt").read_text()


def _last_output_at(job) -> float:
    """When the job's last log line was written, on any node (run.log.times: `<offset> <epoch>` marks)."""
    marks = []
    for node in NODES:
        times = (job.attempt_dir / "nodes" / node / "run.log.times").read_text().split()
        marks += [float(at) for at in times[1::2]]
    return max(marks)


@pytest.mark.parametrize("model", ["hang_allreduce", "hang_init"])
def test_a_hung_run_ends_failure_hang_on_every_node_soon_after_its_last_output(hang_jobs, model):
    job = hang_jobs[model]
    assert job.record["status"] == "FAILURE", job.output[-3000:]
    assert job.record["reason"].startswith("hang"), job.record["reason"]
    last_output = _last_output_at(job)
    for node in NODES:
        status = job.status(node)
        assert status["hang"] is True, status
        assert status["reason"] == f"hang: no rank made progress for {HANG_TIMEOUT} s", status
        # Within hang_timeout + 30 s of the last sign of life: the watchdog, not gloo's hour, ended it.
        assert status["ended_at"] - last_output <= HANG_TIMEOUT + 30, (node, status["ended_at"] - last_output)


def test_the_waiting_ranks_stacks_show_all_reduce_and_the_stuck_ones_its_sleep(hang_jobs):
    job = hang_jobs["hang_allreduce"]
    for node in ("node1", "node2"):
        assert "all_reduce" in _stacks(job, node), _stacks(job, node)
    stuck = _stacks(job, "node3")
    assert "load_batch" in stuck and "time.sleep(3600)" in stuck, stuck
    assert "all_reduce" not in stuck.split("rank 2")[-1], stuck


def test_the_record_names_the_stuck_rank_beside_the_ones_that_wait(hang_jobs):
    job = hang_jobs["hang_allreduce"]
    hang = job.record["hang"]
    assert (hang["kind"], hang["stuck_ranks"], hang["waiting_ranks"]) == ("collective", [2], [0, 1]), hang
    assert "rank 2 (node3)" in job.record["reason"] and "load_batch" in job.record["reason"], job.record["reason"]
    assert sorted(hang["stacks"]) == list(NODES)


def test_a_rank_that_never_joined_is_named_as_a_rendezvous_hang(hang_jobs):
    job = hang_jobs["hang_init"]
    hang = job.record["hang"]
    assert (hang["kind"], hang["never_joined"]) == ("rendezvous", [2]), hang
    assert "init_process_group" in _stacks(job, "node1")
    assert "load_weights" in _stacks(job, "node3")
    assert "never joined" in job.record["reason"], job.record["reason"]


def test_a_quiet_but_busy_rank_is_not_called_hung(hang_jobs):
    job = hang_jobs["quiet_busy"]
    assert job.record["status"] == "SUCCESS", (job.record.get("reason"), job.output[-3000:])
    busy = job.status("node3")
    assert busy["hang"] is False and not (job.attempt_dir / "nodes" / "node3" / "stacks.txt").exists()
    # It stayed quiet four times as long as the timeout, and the run waited for it.
    assert busy["steps"]["run"]["end"] - busy["steps"]["run"]["start"] >= BUSY_SECONDS


def test_stacks_on_demand_show_every_rank_of_a_running_job_and_the_job_goes_on(hang_jobs):
    job = hang_jobs["quiet_busy"]
    shown = ON_DEMAND["run"]
    assert shown.returncode == 0, shown.stderr
    for rank, node in enumerate(NODES):
        assert f"{node} (rank {rank}): slurm-multi-{ON_DEMAND['job']}-r{rank}, on demand" in shown.stdout, shown.stdout
        (written,) = (job.attempt_dir / "nodes" / node).glob("stacks-*.txt")
        assert written.read_text() in shown.stdout
    busy = shown.stdout.split("node3 (rank 2)")[1]
    assert "busy_quietly" in busy, busy
    assert "all_reduce" in shown.stdout.split("node3 (rank 2)")[0], shown.stdout
    assert job.record["status"] == "SUCCESS"
