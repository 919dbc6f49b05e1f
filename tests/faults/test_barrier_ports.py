"""The barrier's ports: taken by another process, sprayed with garbage by a stray client during the run, or held
by an impostor pretending to be rank 0."""

import json
import re
import shlex
import socket
import subprocess
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import format_go_line
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    Session,
    derive_barrier_ports,
    new_nonce,
)
from tests.faults import FAULT_RUN_BOUND, assert_earlier_job_intact, job_containers, results_dir_with_baseline, run_job
from tests.support.ansible import BIN, ROOT, ansible_env
from tests.support.lab.per_mode_jobs import once_per_mode
from tests.support.users.barrier_impostor import BarrierImpostor

pytestmark = [pytest.mark.lab, pytest.mark.fault]

MASTER_ADDR = "127.0.0.11"  # node1, rank 0
# Ranges one port wider than the barrier's 3 candidates: every candidate of any job ID is one of these ports.
TAKEN_RANGE = [24000, 24003]
SPRAYED_RANGE = [24010, 24013]
IMPOSTOR_RANGE = [24020, 24029]
IMAGE = "sha256:" + "a" * 64
# Far beyond the run's bound: the workers must stop at rank 0's ABORT marker, not at their own deadline.
LONG_BARRIER_TIMEOUT = 900


@pytest.fixture(scope="module")
def results(lab_cluster, tmp_path_factory):
    """(results dir holding an earlier successful job, its job ID, its perf row)."""
    results_dir = tmp_path_factory.mktemp("barrier-ports") / "results"
    earlier_job, earlier_row = results_dir_with_baseline(tmp_path_factory.getbasetemp(), results_dir)
    return results_dir, earlier_job, earlier_row


@pytest.fixture(scope="module")
def ports_taken_runs(results):
    """mode -> a run whose whole barrier port range on rank 0's address is held by listeners of another process."""

    def run_in(mode):
        listeners = []
        try:
            for port in range(TAKEN_RANGE[0], TAKEN_RANGE[1] + 1):
                sock = socket.socket()
                sock.bind((MASTER_ADDR, port))
                sock.listen(16)
                listeners.append(sock)
            return run_job(
                results[0],
                # node1 must be rank 0, on MASTER_ADDR: SLURM may pick node4.. of a grown lab over busy node1-3.
                nodelist="node[1-3]",
                model_tags=["dummy"],
                barrier_port_range=TAKEN_RANGE,
                barrier_timeout=LONG_BARRIER_TIMEOUT,
            )
        finally:
            for sock in listeners:
                sock.close()

    return once_per_mode(run_in, output=lambda made: made.output)


def test_taken_barrier_ports_fail_the_run_in_bounded_time(ports_taken_runs, pipeline_mode):
    run = ports_taken_runs(pipeline_mode)
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND < LONG_BARRIER_TIMEOUT


def test_workers_stop_at_rank0s_abort_marker_with_its_reason(ports_taken_runs, pipeline_mode):
    run = ports_taken_runs(pipeline_mode)
    marker = json.loads((run.attempt_dir / "ABORT").read_text())
    assert (marker["rank"], marker["node"]) == (0, "node1")
    assert f"every barrier port candidate on {MASTER_ADDR} is in use" in marker["reason"]
    for node, rank in (("node2", 1), ("node3", 2)):
        status = run.status(node)
        # In pull mode a worker may still be waiting for rank 0's image (no barrier yet) when rank 0 gives up.
        stopped_at = (
            f"rank {rank} waited at the barrier: rank 0 (node1) gave up: every barrier port",
            "this node waited for rank 0's image: rank 0 (node1) failed: every barrier port",
            # The run module meets the others at the barrier: one that starts after rank 0 gave up reads its marker.
            "aborted because rank 0 (node1) failed: every barrier port",
        )
        assert any(where in status["reason"] for where in stopped_at), status["reason"]
        assert status["aborted_by_rank"] == 0


def test_the_record_blames_rank0_alone_and_the_workers_as_stopped_by_it(ports_taken_runs, pipeline_mode):
    run = ports_taken_runs(pipeline_mode)
    nodes = run.record["per_node"]
    assert [nodes[node]["root_cause"] for node in ("node1", "node2", "node3")] == [True, False, False], nodes
    assert run.record["reason"].startswith("node1 (rank 0): "), run.record["reason"]
    assert "node2 (rank 1), node3 (rank 2): stopped because rank 0 failed" in run.record["reason"]


def test_taken_barrier_ports_are_named_in_the_failure_record(ports_taken_runs, pipeline_mode):
    run = ports_taken_runs(pipeline_mode)
    reason = run.record["reason"]
    assert run.record["status"] == "FAILURE"
    assert f"every barrier port candidate on {MASTER_ADDR} is in use" in reason, reason
    assert any(str(port) in reason for port in range(TAKEN_RANGE[0], TAKEN_RANGE[1] + 1)), reason
    assert "node1" in reason, reason


def test_taken_barrier_ports_leave_no_container_and_keep_the_earlier_job(ports_taken_runs, results, pipeline_mode):
    run = ports_taken_runs(pipeline_mode)
    assert job_containers(run.job_id) == []
    assert_earlier_job_intact(*results)


def test_a_rerun_once_the_ports_are_free_succeeds(ports_taken_runs, results, pipeline_mode):
    ports_taken_runs(pipeline_mode)  # the run that held the ports, over: they are free again
    rerun = run_job(results[0], model_tags=["dummy"], barrier_port_range=TAKEN_RANGE, barrier_timeout=60)
    assert rerun.rc == 0, rerun.output[-3000:]
    assert_earlier_job_intact(*results)


class GarbageSprayer(threading.Thread):
    """Connects to every port of a range again and again, sending junk, oversized and half lines, or nothing."""

    PAYLOADS = (
        b"\x00\xff" * 64 + b"\n",
        b"READY wrong-token 1 node2 sha256:abc\n",  # the previous protocol's READY
        b"JOIN 1 " + b"0" * 32 + b"\nREADY node2 sha256:abc " + b"0" * 64 + b"\n",  # a READY with a made-up MAC
        b"READY " + b"x" * 4096 + b"\n",
        b"GET / HTTP/1.0\r\n\r\n",
        b"READY half-a-line",
        b"",
    )

    def __init__(self, address, ports):
        super().__init__(daemon=True)
        self.address, self.ports = address, ports
        self.stop = threading.Event()
        self.delivered = 0

    def run(self):
        index = 0
        while not self.stop.is_set():
            for port in self.ports:
                payload = self.PAYLOADS[index % len(self.PAYLOADS)]
                index += 1
                try:
                    with socket.create_connection((self.address, port), timeout=0.5) as sock:
                        sock.sendall(payload)
                        self.delivered += 1
                except OSError:
                    pass  # no barrier listening on that port yet (or any more)
            time.sleep(0.05)


def _barrier_call(nodes, job_id, port_range=SPRAYED_RANGE, token="lab-garbage-test-token"):
    """`ansible <nodes> -m rank_barrier`: every node of the allocation at the barrier with the same image."""
    args = {
        "rank": "{{ node_rank }}",
        "nnodes": 3,
        "hosts": ["node1", "node2", "node3"],
        "master_addr": MASTER_ADDR,
        "master_port": 29500,
        "job_id": job_id,
        "token": token,
        "timeout": 60,
        "image_id": IMAGE,
        "port_range": f"{port_range[0]}-{port_range[1]}",
    }
    return [str(BIN / "ansible"), nodes, "-m", "rank_barrier", "-f", "3", "-a", json.dumps(args)]


def _results(output):
    """What `ansible` printed per node (`node | SUCCESS => {...}`, the JSON closing at the start of a line):
    {node: the module's result}."""
    return {
        node: json.loads(result)
        for node, result in re.findall(r"^(\S+) \| [A-Z!]+ => (\{.*?^\})", output, re.DOTALL | re.MULTILINE)
    }


@pytest.fixture(scope="module")
def sprayed_barrier(lab_cluster, tmp_path_factory):
    """The real barrier module on the 3 lab nodes, rank 0 serving for seconds while a client sprays garbage at
    every port of its range; only then do the two workers join. (A whole pipeline run holds the barrier for
    milliseconds, too short to be hit reliably.)"""
    out = tmp_path_factory.mktemp("sprayed-barrier")
    script = out / "barrier.sh"
    script.write_text(
        f"#!/bin/sh\ncd {ROOT}\n"
        f"{shlex.join(_barrier_call('node1', '990001'))} > {out}/rank0.out 2>&1 &\n"
        f"sleep 6\n"
        f"{shlex.join(_barrier_call('node2,node3', '990001'))} > {out}/workers.out 2>&1\n"
        f"echo workers=$? > {out}/rc\nwait $!\necho rank0=$? >> {out}/rc\n"
    )
    sprayer = GarbageSprayer(MASTER_ADDR, range(SPRAYED_RANGE[0], SPRAYED_RANGE[1] + 1))
    sprayer.start()
    try:
        subprocess.run(
            ["salloc", "-N", "3", "--quiet", "sh", str(script)], env=ansible_env(), timeout=180, capture_output=True
        )
    finally:
        sprayer.stop.set()
        sprayer.join(5)
    return out, sprayer


# The barrier module called by itself (`ansible -m rank_barrier`: no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_a_garbage_spraying_client_does_not_break_the_barrier(sprayed_barrier):
    out, sprayer = sprayed_barrier
    assert sprayer.delivered > 0, "the sprayer never reached a barrier port: the test proved nothing"
    assert (out / "rc").read_text().split() == ["workers=0", "rank0=0"], (out / "rank0.out").read_text()[-2000:] + (
        out / "workers.out"
    ).read_text()[-2000:]


# The barrier module called by itself (`ansible -m rank_barrier`: no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_the_barrier_reports_the_garbage_it_rejected(sprayed_barrier):
    out, _ = sprayed_barrier
    rank0 = (out / "rank0.out").read_text()
    assert "connection(s) at the barrier" in rank0 and "rejected" in rank0, rank0[-3000:]


IMPOSTOR_JOB = "990002"
IMPOSTOR_TOKEN = "lab-impostor-test-token"


@pytest.fixture(scope="module")
def impostor_barrier(lab_cluster, tmp_path_factory):
    """The real barrier module on the 3 lab nodes while a local user holds the job's first candidate port on
    rank 0's address, relays greetings from the real rank 0 (on the second), replays what it captures and
    answers each worker's READY with a GO of its own. The workers start once rank 0 listens, so that the
    impostor has a greeting to relay to each of them."""
    out = tmp_path_factory.mktemp("impostor-barrier")
    first, second = derive_barrier_ports(29500, IMPOSTOR_JOB, tuple(IMPOSTOR_RANGE))[:2]
    forged = format_go_line("a-guessed-token", Session(IMPOSTOR_JOB, 1, "node2", new_nonce(), new_nonce()), IMAGE)
    calls = {
        nodes: shlex.join(_barrier_call(nodes, IMPOSTOR_JOB, IMPOSTOR_RANGE, IMPOSTOR_TOKEN))
        for nodes in ("node1", "node2,node3")
    }
    script = out / "barrier.sh"
    script.write_text(
        f"#!/bin/sh\ncd {ROOT}\n"
        f"{calls['node1']} > {out}/rank0.out 2>&1 &\n"
        f"i=0; until ss -ltnH src {MASTER_ADDR}:{second} | grep -q .; do\n"
        f"  i=$((i + 1)); [ $i -gt 600 ] && break; sleep 0.1\ndone\n"
        f"{calls['node2,node3']} > {out}/workers.out 2>&1\n"
        f"echo workers=$? > {out}/rc\nwait $!\necho rank0=$? >> {out}/rc\n"
    )
    with BarrierImpostor(MASTER_ADDR, first, second, forged) as impostor:
        subprocess.run(
            ["salloc", "-N", "3", "--quiet", "sh", str(script)],
            timeout=240,
            capture_output=True,
            env=ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json"),
        )
    rank0, workers = ((out / name).read_text() for name in ("rank0.out", "workers.out"))
    return (out / "rc").read_text().split(), _results(rank0 + workers), impostor, first, second, rank0 + workers


# The barrier module called by itself (`ansible -m rank_barrier`: no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_an_impostor_on_the_first_port_releases_no_worker_and_the_real_barrier_does(impostor_barrier):
    rc, results, impostor, first, second, output = impostor_barrier
    assert len(impostor.replayed) == 2, f"the impostor deceived {len(impostor.replayed)} worker(s): {output[-3000:]}"
    assert all(deception.forged_sent for deception in impostor.replayed)
    assert rc == ["workers=0", "rank0=0"], output[-3000:]
    assert {node: results[node]["port"] for node in ("node1", "node2", "node3")} == dict.fromkeys(
        ("node1", "node2", "node3"), second
    )
    assert [worker["rank"] for worker in results["node1"]["workers"]] == [1, 2]


# The barrier module called by itself (`ansible -m rank_barrier`: no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_each_worker_reports_the_impostors_go_it_refused(impostor_barrier):
    _, results, _, first, _, _ = impostor_barrier
    for node in ("node2", "node3"):
        [refused] = results[node]["rejected"]
        assert refused["peer"] == f"{MASTER_ADDR}:{first}"
        assert refused["reason"].startswith("GO failed authentication"), refused


# The barrier module called by itself (`ansible -m rank_barrier`: no pipeline, no mode): once, not per mode.
@pytest.mark.mode_independent
def test_what_the_impostor_captured_is_rejected_by_the_real_rank0_and_holds_no_token(impostor_barrier):
    _, results, impostor, _, _, output = impostor_barrier
    assert [deception.replay_answer for deception in impostor.replayed] == [b"", b""]
    replays = [r for r in results["node1"]["rejected"] if "READY failed authentication" in r["reason"]]
    assert sorted(r["reason"].split(":")[0] for r in replays) == ["rank 1", "rank 2"], results["node1"]["rejected"]
    assert IMPOSTOR_TOKEN.encode() not in b"".join(deception.captured for deception in impostor.deceptions)
    assert IMPOSTOR_TOKEN not in output
