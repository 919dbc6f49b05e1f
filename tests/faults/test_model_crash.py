"""The model container crashes on one rank mid-run: every other rank stops within seconds, the record says why."""

import json
import shutil
from pathlib import Path

import pytest

from tests.faults import (
    FAULT_RUN_BOUND,
    NODELIST,
    NODES,
    assert_earlier_job_intact,
    job_containers,
    results_dir_with_baseline,
    run_job,
)
from tests.support.lab.per_mode_jobs import MODES, both_modes_at_once

# lab_shared: the crash is its own job's; its bounds (60 s, FAULT_RUN_BOUND) hold beside another job, as
# test_pipeline_lab's crash does.
pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.lab_shared]

MODELS = Path(__file__).resolve().parents[2] / "models"
# The healthy ranks' models sleep for 600 s; fail-fast must stop them long before.
STOPPED_WITHIN = 60
RANK0_CRASH_SCRIPT = """#!/bin/sh
# Rank 0 (the one that built the image and served the barrier) crashes; the others hang in a collective.
. "$(dirname "$0")/common.sh"
if [ "$NODE_RANK" -eq 0 ]; then
  sleep 2
  echo "RuntimeError: simulated crash of rank $NODE_RANK" >&2
  exit 7
fi
sleep 600
echo "performance: 1 samples_per_second"
"""


@pytest.fixture(scope="module")
def results(lab_cluster, tmp_path_factory):
    """mode -> (results dir holding an earlier successful job, its job ID, its perf row): one per mode, as each
    crash runs in both modes side by side."""
    made = {}
    for mode in MODES:
        results_dir = tmp_path_factory.mktemp(f"model-crash-{mode}") / "results"
        made[mode] = (results_dir, *results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir))
    return made


@pytest.fixture(scope="module")
def rank0_crash_models_file(tmp_path_factory):
    """A copy of the sample zoo with one more card, `dummy_fail_rank0`, whose rank 0 exits 7 after 2 s."""
    zoo = tmp_path_factory.mktemp("crash-zoo") / "models"
    shutil.copytree(MODELS, zoo)
    script = zoo / "scripts" / "dummy" / "run_fail_rank0.sh"
    script.write_text(RANK0_CRASH_SCRIPT)
    script.chmod(0o755)
    cards = json.loads((zoo / "models.json").read_text())
    (card,) = [dict(c) for c in cards if c["name"] == "dummy_fail"]
    card.update(name="dummy_fail_rank0", scripts="scripts/dummy/run_fail_rank0.sh", tags=["faults"])
    (zoo / "models.json").write_text(json.dumps(cards + [card], indent=2))
    return zoo / "models.json"


@pytest.fixture(scope="module", params=[("node2", 1, 3), ("node1", 0, 7)], ids=["rank1", "rank0"])
def crash_run(request, results, rank0_crash_models_file):
    """mode -> (run, crashed node, crashed rank, its exit code) for a crash on rank 1 (dummy_fail) and on rank 0;
    both modes' runs side by side (the bound on the other ranks' stop holds under that load: see STOPPED_WITHIN)."""
    node, rank, exit_code = request.param

    def run_in(mode):
        if rank == 0:
            run = run_job(
                results[mode][0],
                mode=mode,
                nodelist=NODELIST,
                model_tags=["dummy_fail_rank0"],
                models_file=str(rank0_crash_models_file),
            )
        else:
            run = run_job(results[mode][0], mode=mode, nodelist=NODELIST, model_tags=["dummy_fail"])
        return run, node, rank, exit_code

    return both_modes_at_once(run_in, output=lambda made: made[0].output)


def test_the_crashed_rank_is_a_failure_with_its_exit_code(crash_run, pipeline_mode):
    run, node, _, exit_code = crash_run(pipeline_mode)
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    status = run.status(node)
    assert (status["status"], status["exit_code"]) == ("FAILURE", exit_code), status


def test_the_other_ranks_stop_within_seconds(crash_run, pipeline_mode):
    run, node, rank, _ = crash_run(pipeline_mode)
    for other in (n for n in NODES if n != node):
        status = run.status(other)
        assert status["aborted_by_rank"] == rank, status
        assert status["ended_at"] - status["started_at"] < STOPPED_WITHIN, status


def test_the_failure_record_names_the_crashed_node(crash_run, pipeline_mode):
    run, node, _, _ = crash_run(pipeline_mode)
    assert run.record["status"] == "FAILURE"
    assert node in run.record["reason"], run.record["reason"]


def test_the_crashed_rank_leaves_diagnostics(crash_run, pipeline_mode):
    run, node, rank, _ = crash_run(pipeline_mode)
    diagnostics = (run.attempt_dir / "nodes" / node / "diagnostics.txt").read_text()
    assert "simulated" in diagnostics and f"rank {rank}" in diagnostics, diagnostics[-2000:]


def test_a_crash_leaves_no_container_and_keeps_the_earlier_job(crash_run, results, pipeline_mode):
    run, *_ = crash_run(pipeline_mode)
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(*results[pipeline_mode])
