"""The retry rule (module_utils/results/retry_cause.py) on records the lab produced (tests/fixtures/records/).

Each fixture is an attempt record as collect wrote it on the lab: a node lost mid-build (iptables DROP), a model
crash on rank 1 (dummy_fail), rank 0's barrier ports all taken, a malformed manifest failing every node, and, from
tests/faults/test_node_retry.py's runs, node3's Docker daemon stopped (push and pull; before and since the preflight
stage).
"""

import copy
import json
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.retry_cause import (
    MODEL,
    NO_FAILURE,
    NODES,
    STOPPED,
    UNATTRIBUTED,
    failure_cause,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "records"


def _record(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_a_node_lost_mid_build_is_attributable_to_that_node():
    cause = failure_cause(_record("node3-lost-mid-build"))
    assert cause.kind == NODES and list(cause.nodes) == ["node3"], cause
    assert "lost or unreachable" in cause.nodes["node3"]


def test_no_node_leaving_a_status_blames_none_of_them():
    # The pipeline never reached the nodes (it failed to start, or was killed): nothing says a node is at fault.
    record = _record("node3-lost-mid-build")
    for entry in record["per_node"].values():
        entry.update(root_cause=True, reason="no status.json: its run stage never ran or the node was lost")
    assert failure_cause(record).kind == UNATTRIBUTED


def test_a_model_crash_is_never_attributable_to_a_node():
    cause = failure_cause(_record("model-crash-rank1"))
    assert (cause.kind, cause.nodes) == (MODEL, {}), cause
    assert "node2 (rank 1)" in cause.why and "exited with code 3" in cause.why


def test_a_model_that_exited_non_zero_without_an_error_pattern_is_the_models_failure():
    record = _record("model-crash-rank1")
    node2 = record["per_node"]["node2"]
    node2.update(exit_code=3, error_pattern=None, log={"error_pattern": None, "perf_lines": 0})
    assert failure_cause(record).kind == MODEL


def test_a_model_failure_beside_a_lost_node_is_still_not_retried():
    record = _record("model-crash-rank1")
    record["per_node"]["node3"].update(
        root_cause=True, reason="no status.json: its run stage never ran or the node was lost"
    )
    assert failure_cause(record).kind == MODEL


@pytest.mark.parametrize("name", ["docker-down-node3-push", "docker-down-node3-pull"])
def test_a_stopped_docker_daemon_blames_its_node(name):
    # Recorded before the preflight stage existed: the preparation stage found it.
    cause = failure_cause(_record(name))
    assert cause.kind == NODES and list(cause.nodes) == ["node3"], cause
    assert cause.nodes["node3"] == "Docker daemon not answering"


@pytest.mark.parametrize("name", ["preflight-docker-down-node3-push", "preflight-docker-down-node3-pull"])
def test_a_node_the_preflight_stage_found_a_problem_on_is_blamed(name):
    # Pull mode: every node failed the stage (the others for node3's problems); the record's preflight section
    # names node3 alone.
    record = _record(name)
    assert record["preflight"]["node3"] and not record["preflight"]["node1"]
    cause = failure_cause(record)
    assert cause.kind == NODES and list(cause.nodes) == ["node3"], cause
    assert cause.nodes["node3"].startswith("preflight: Docker daemon not answering on node3")


def test_a_failure_of_every_node_in_one_stage_is_the_jobs_input_not_a_node():
    record = _record("malformed-manifest-every-node")
    for entry in record["per_node"].values():  # the status's stage, which per_node carries since retries
        entry.update(stage="preparation", exit_code=None)
    cause = failure_cause(record)
    assert cause.kind == UNATTRIBUTED and cause.nodes == {}, cause


def test_rank0s_build_stage_failure_is_not_a_node():
    # Building and publishing depend on the Dockerfile, the registry and the cache dir.
    assert failure_cause(_record("rank0-barrier-ports-taken")).kind == UNATTRIBUTED


def test_the_ranks_rank0s_barrier_gave_up_on_are_blamed_by_node():
    record = _record("rank0-barrier-ports-taken")
    # rank_barrier's own words when rank 0's deadline passes (RankBarrierServer._give_up).
    record["per_node"]["node1"]["node_reason"] = (
        "the build stage failed on node1: rank 0 gave up after 600 s: missing ranks 2 (node3)"
    )
    cause = failure_cause(record)
    assert cause.kind == NODES and cause.nodes == {"node3": "rank 2 never reached the barrier"}, cause


def test_a_barrier_message_naming_ranks_without_hosts_maps_them_to_nodes():
    record = _record("rank0-barrier-ports-taken")
    record["per_node"]["node1"]["node_reason"] = (
        "the build stage failed on node1: rank 0 gave up after 5 s: missing ranks 1, 2"
    )
    assert list(failure_cause(record).nodes) == ["node2", "node3"]


def test_a_worker_whose_stage_failed_before_the_model_ran_is_blamed():
    record = _record("malformed-manifest-every-node")
    for node in ("node1", "node3"):  # only node2 failed by itself; the others were stopped because of it
        record["per_node"][node].update(root_cause=False)
    # Recorded before per_node carried the status's stage (status.json said "preparation") and exit code (null).
    record["per_node"]["node2"].update(stage="preparation", exit_code=None)
    cause = failure_cause(record)
    assert list(cause.nodes) == ["node2"] and "preparation stage failed" in cause.nodes["node2"], cause


def test_a_worker_that_gave_up_because_another_rank_failed_is_not_blamed():
    # Pull mode: node2 gave up waiting for rank 0's image because node3 failed; only node3 is to blame.
    record = _record("docker-down-node3-pull")
    node3 = record["per_node"]["node3"]
    node3["node_reason"] = node3["reason"] = "the preparation stage failed on node3: /dev/kfd is missing"
    node2 = record["per_node"]["node2"]
    assert node2["root_cause"] and "rank 2 (node3) failed" in node2["node_reason"]
    node2["node_reason"] = node2["node_reason"].split(" failed: ")[0] + " failed: " + node3["node_reason"]
    cause = failure_cause(record)
    assert list(cause.nodes) == ["node3"], cause


def test_preflight_problems_blame_their_nodes():
    record = _record("node3-lost-mid-build")
    record["preflight"] = {
        "node1": [],
        "node2": [{"check": "disk", "problem": "2 GB free under /var/lib/docker, the image needs 9 GB", "fix": "..."}],
    }
    cause = failure_cause(record)
    assert set(cause.nodes) == {"node2", "node3"} and "2 GB free" in cause.nodes["node2"]


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT"])
def test_a_cancelled_or_timed_out_job_is_not_retried(state):
    record = _record("node3-lost-mid-build")
    record["slurm_state"] = state
    assert failure_cause(record).kind == STOPPED


def test_a_successful_attempt_has_no_cause():
    record = copy.deepcopy(_record("node3-lost-mid-build"))
    record["status"] = "SUCCESS"
    assert failure_cause(record).kind == NO_FAILURE
