"""The `rank_barrier` module as Ansible runs it: one playbook over two local "nodes", with the repo's ansible.cfg.

Ansible's start-up costs seconds, so one `ansible-playbook -vvv` run records what every case returned and the
tests below each check one behaviour in that record (and in the run's whole output, for the token).
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import format_go_line
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    Session,
    derive_barrier_ports,
    new_nonce,
)
from tests.support.users.barrier_impostor import BarrierImpostor

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
TOKEN = "module-test-Token-7f3a9c"
IMAGE = "sha256:" + "c" * 64

PLAYBOOK = """
- name: Exercise the rank barrier on two local nodes
  hosts: nodes
  gather_facts: false
  vars:
    barrier: &barrier
      master_addr: 127.0.0.1
      master_port: "{{ master_port }}"
      token: "{{ barrier_token }}"
      image_id: "{{ image_id }}"
  tasks:
    - name: Wait at the barrier on both nodes
      rank_barrier:
        <<: *barrier
        rank: "{{ node_rank }}"
        nnodes: 2
        hosts: [node1, node2]
        job_id: "{{ job_id }}-release"
        timeout: 30
      register: release

    - name: Release both nodes on the next candidate port while an impostor holds the first
      rank_barrier:
        <<: *barrier
        rank: "{{ node_rank }}"
        nnodes: 2
        hosts: [node1, node2]
        job_id: "{{ impostor_job_id }}"
        timeout: 60
      register: impostor

    - name: Time out on rank 0 with two ranks missing
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 3
        hosts: [gpu01, gpu02, gpu03]
        job_id: "{{ job_id }}-rank0-timeout"
        timeout: 0.5
      when: node_rank == 0
      ignore_errors: true
      register: rank0_timeout

    - name: Time out on a worker whose rank 0 never listens
      rank_barrier:
        <<: *barrier
        rank: 1
        nnodes: 2
        job_id: "{{ job_id }}-worker-timeout"
        timeout: 0.5
      when: node_rank == 1
      ignore_errors: true
      register: worker_timeout

    - name: Return at once in check mode
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 2
        job_id: "{{ job_id }}-check"
        timeout: 600
      check_mode: true
      when: node_rank == 0
      register: checked

    - name: Refuse a reversed port range
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 2
        job_id: "{{ job_id }}-bad-range"
        port_range: 30000-20000
      when: node_rank == 0
      ignore_errors: true
      register: bad_range

    - name: Fail on both nodes when every port of rank 0 is taken; the worker stops at rank 0's ABORT marker
      rank_barrier:
        <<: *barrier
        rank: "{{ node_rank }}"
        nnodes: 2
        hosts: [node1, node2]
        job_id: "{{ job_id }}-ports-taken"
        job_dir: "{{ record_dir }}/job"
        port_range: "{{ taken_port_range }}"
        timeout: 120
      ignore_errors: true
      register: ports_taken

    - name: Give up on rank 0 a worker whose playbook heartbeat stands still, long before the timeout (pull mode)
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 3
        hosts: [node1, gpu02, gpu03]
        job_id: "{{ job_id }}-dead-worker"
        job_dir: "{{ record_dir }}/beats"
        heartbeat_stale: 1
        timeout: 60
      when: node_rank == 0
      ignore_errors: true
      register: dead_worker

    - name: Stop a worker whose rank 0's playbook heartbeat stands still, long before the timeout (pull mode)
      rank_barrier:
        <<: *barrier
        rank: 1
        nnodes: 2
        hosts: [gpu01, node2]
        job_id: "{{ job_id }}-dead-rank0"
        job_dir: "{{ record_dir }}/beats"
        heartbeat_stale: 1
        timeout: 20
      when: node_rank == 1
      ignore_errors: true
      register: dead_rank0

    - name: Give up on rank 0 whose own playbook heartbeat stands still, its worker beating (pull mode)
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 2
        hosts: [gpu01, gpu02]
        job_id: "{{ job_id }}-orphaned-rank0"
        job_dir: "{{ record_dir }}/orphan"
        heartbeat_stale: 1
        timeout: 20
      when: node_rank == 0
      ignore_errors: true
      register: orphaned_rank0

    - name: Release both nodes in push mode, rank 0 beating its module heartbeat
      rank_barrier:
        <<: *barrier
        rank: "{{ node_rank }}"
        nnodes: 2
        hosts: [node1, node2]
        job_id: "{{ job_id }}-push-beat"
        job_dir: "{{ record_dir }}/push"
        heartbeat: module
        heartbeat_stale: 1
        timeout: 20
      register: push_beat

    - name: Refuse a negative heartbeat_stale
      rank_barrier:
        <<: *barrier
        rank: 0
        nnodes: 2
        job_id: "{{ job_id }}-bad-stale"
        heartbeat_stale: -1
      when: node_rank == 0
      ignore_errors: true
      register: bad_stale

    - name: Gather what the module returned on this node
      set_fact:
        outcomes:
          ports_taken: "{{ ports_taken }}"
          release: "{{ release }}"
          impostor: "{{ impostor }}"
          rank0_timeout: "{{ rank0_timeout }}"
          worker_timeout: "{{ worker_timeout }}"
          checked: "{{ checked }}"
          bad_range: "{{ bad_range }}"
          dead_worker: "{{ dead_worker }}"
          bad_stale: "{{ bad_stale }}"
          dead_rank0: "{{ dead_rank0 }}"
          orphaned_rank0: "{{ orphaned_rank0 }}"
          push_beat: "{{ push_beat }}"

    - name: Record what the module returned on both nodes
      copy:
        dest: "{{ record_dir }}/records.json"
        content: "{{ {'node1': hostvars.node1.outcomes, 'node2': hostvars.node2.outcomes} | to_json }}"
      run_once: true
"""


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listeners_on_a_whole_port_range(width=4):
    """Listening sockets holding every port of some free LOW-HIGH range on 127.0.0.1: (range text, sockets)."""
    for low in range(31000, 33000, width):
        held = []
        try:
            for port in range(low, low + width):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
                sock.listen(8)
            return f"{low}-{low + width - 1}", held
        except OSError:
            for sock in held:
                sock.close()
    raise RuntimeError("no free range of ports to occupy on 127.0.0.1")


def impostor_on_the_first_candidate(master_port):
    """(job ID, impostor) for a job whose first barrier port on 127.0.0.1 the impostor holds; it relays greetings
    to the second, where rank 0 will listen, and answers READY with a GO under a guessed token."""
    for _ in range(20):
        job_id = f"{uuid.uuid4().hex}-impostor"
        first, second = derive_barrier_ports(master_port, job_id)[:2]
        forged = format_go_line("a-guessed-token", Session(job_id, 1, "node2", new_nonce(), new_nonce()), IMAGE)
        try:
            return job_id, BarrierImpostor("127.0.0.1", first, second, forged)
        except OSError:
            continue  # that port is taken on this machine: another job ID
    raise RuntimeError("no free first candidate port for the impostor on 127.0.0.1")


def beat_until(node_dir, stop):
    """A live node's playbook heartbeat in `node_dir`, rewritten as roles/preparation does, until `stop` is set."""
    while not stop.wait(0.2):
        (node_dir / "playbook.alive.tmp").write_text(f"4444 {time.time()}\n")
        (node_dir / "playbook.alive.tmp").replace(node_dir / "playbook.alive")


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """(records by node name, the run's whole output, the impostor) of the playbook above."""
    work = tmp_path_factory.mktemp("rank_barrier_module")
    (work / "job").mkdir()
    # gpu02's playbook heartbeat stands still (its node died); gpu03 never wrote one.
    (work / "beats" / "nodes" / "gpu02").mkdir(parents=True)
    (work / "beats" / "nodes" / "gpu02" / "playbook.alive").write_text("4242 1733150000.5\n")
    # gpu01, a rank 0, stands still too: for its worker, and (in orphan/) for itself while its worker gpu02 beats.
    for job_dir in ("beats", "orphan"):
        (work / job_dir / "nodes" / "gpu01").mkdir(parents=True)
        (work / job_dir / "nodes" / "gpu01" / "playbook.alive").write_text("4343 1733150000.5\n")
    (work / "orphan" / "nodes" / "gpu02").mkdir(parents=True)
    (work / "push" / "nodes" / "node1").mkdir(parents=True)
    master_port = free_port()
    impostor_job_id, impostor = impostor_on_the_first_candidate(master_port)
    taken_port_range, occupants = listeners_on_a_whole_port_range()
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "nodes": {
            "hosts": {"node1": dict(host, node_rank=0), "node2": dict(host, node_rank=1)},
            "vars": {
                "master_port": master_port,
                "job_id": uuid.uuid4().hex,
                "barrier_token": TOKEN,
                "impostor_job_id": impostor_job_id,
                "image_id": IMAGE,
                "record_dir": str(work),
                "taken_port_range": taken_port_range,
            },
        }
    }
    (work / "inventory.yml").write_text(json.dumps(inventory))
    (work / "playbook.yml").write_text(PLAYBOOK)
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_INVENTORY_ENABLED="yaml",  # this file only; the SLURM plugin would claim it first
        ANSIBLE_FORKS="2",  # both nodes at the barrier at once
    )
    stop_beating = threading.Event()
    beating = threading.Thread(target=beat_until, args=(work / "orphan" / "nodes" / "gpu02", stop_beating))
    beating.start()
    try:
        completed = subprocess.run(
            [str(BIN / "ansible-playbook"), "-vvv", "-i", str(work / "inventory.yml"), str(work / "playbook.yml")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop_beating.set()
        beating.join()
        impostor.close()
        for sock in occupants:
            sock.close()
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    records = json.loads((work / "records.json").read_text())
    return records, completed.stdout + completed.stderr + json.dumps(records), impostor, work


def test_rank0_and_a_worker_release_each_other(played):
    records = played[0]
    rank0, worker = records["node1"]["release"], records["node2"]["release"]
    assert not rank0.get("failed") and not worker.get("failed"), (rank0, worker)
    assert rank0["port"] == worker["port"] and rank0["port"] in rank0["ports"]
    assert [w["rank"] for w in rank0["workers"]] == [1]


def test_the_barrier_changes_nothing(played):
    records = played[0]
    assert [records[node]["release"]["changed"] for node in ("node1", "node2")] == [False, False]


def test_an_impostor_on_the_first_port_neither_releases_the_worker_nor_learns_anything_replayable(played):
    records, _, impostor, _ = played
    rank0, worker = records["node1"]["impostor"], records["node2"]["impostor"]
    assert [deception.forged_sent for deception in impostor.replayed] == [True], impostor.deceptions
    # Released by the real rank 0 on the second candidate, after refusing the impostor's GO on the first.
    assert not rank0.get("failed") and not worker.get("failed"), (rank0, worker)
    assert worker["port"] == rank0["port"] == rank0["ports"][1] != impostor.port
    assert [(r["peer"], r["reason"].split(":")[0]) for r in worker["rejected"]] == [
        (f"127.0.0.1:{impostor.port}", "GO failed authentication")
    ]
    # What the impostor captured, replayed to the real rank 0 on a fresh connection, was rejected.
    assert impostor.replayed[0].replay_answer == b""
    assert "rank 1: READY failed authentication" in [r["reason"].split(" (")[0] for r in rank0["rejected"]]
    assert TOKEN.encode() not in b"".join(deception.captured for deception in impostor.deceptions)


def test_rank0_timeout_fails_naming_the_missing_ranks_and_hosts(played):
    result = played[0]["node1"]["rank0_timeout"]
    assert result["failed"] is True
    assert "missing ranks 1 (gpu02), 2 (gpu03)" in result["msg"]
    assert result["missing"] == [{"rank": 1, "host": "gpu02"}, {"rank": 2, "host": "gpu03"}]


def test_worker_timeout_fails_saying_where_it_looked(played):
    result = played[0]["node2"]["worker_timeout"]
    assert result["failed"] is True
    assert "rank 1 got no GO from rank 0 at 127.0.0.1" in result["msg"]


def test_rank0_that_cannot_listen_leaves_the_abort_marker_naming_why(played):
    result = played[0]["node1"]["ports_taken"]
    assert result["failed"] is True
    assert "every barrier port candidate on 127.0.0.1 is in use" in result["msg"]


def test_a_worker_stops_at_rank0s_abort_marker_long_before_its_timeout(played):
    result = played[0]["node2"]["ports_taken"]
    assert result["failed"] is True
    # Only the marker carries rank 0's reason to the worker; at its 120 s timeout it would say "got no GO".
    assert "rank 1 waited at the barrier: rank 0 (node1) gave up: every barrier port candidate" in result["msg"]
    assert result["aborted_by_rank"] == 0


def test_rank0_gives_up_a_worker_whose_heartbeat_stood_still_long_before_its_timeout(played):
    outcome = played[0]["node1"]["dead_worker"]
    assert outcome["failed"] is True
    assert "rank 1 (gpu02) stopped its heartbeat" in outcome["msg"] and "gave up after" not in outcome["msg"], outcome
    assert outcome["step"]["end"] - outcome["step"]["start"] < 30, outcome  # its timeout: 60 s


def test_a_worker_stops_once_rank0s_playbook_heartbeat_stood_still_naming_rank0(played):
    outcome = played[0]["node2"]["dead_rank0"]
    assert outcome["failed"] is True
    assert "rank 1 waited at the barrier: rank 0 (gpu01)'s playbook stopped its heartbeat" in outcome["msg"], outcome
    assert outcome["aborted_by_rank"] == 0  # the node's status then blames rank 0, not this worker
    assert outcome["step"]["end"] - outcome["step"]["start"] < 10, outcome  # its timeout: 20 s


def test_rank0_whose_own_playbook_died_gives_up_and_leaves_the_abort_marker_naming_itself(played):
    outcome = played[0]["node1"]["orphaned_rank0"]
    assert outcome["failed"] is True
    assert "rank 0 (gpu01)'s own playbook stopped its heartbeat" in outcome["msg"], outcome
    assert outcome["step"]["end"] - outcome["step"]["start"] < 10, outcome
    marker = json.loads((played[3] / "orphan" / "ABORT").read_text())
    assert (marker["rank"], marker["node"]) == (0, "gpu01") and "own playbook stopped" in marker["reason"], marker


def test_push_mode_rank0_beats_its_module_heartbeat_while_it_releases_the_workers(played):
    records = played[0]
    assert not records["node1"]["push_beat"].get("failed") and not records["node2"]["push_beat"].get("failed")
    beat = (played[3] / "push" / "nodes" / "node1" / "module.alive").read_text().split()
    assert len(beat) == 2 and beat[0].isdigit(), beat


def test_a_negative_heartbeat_stale_is_refused_saying_what_is_expected(played):
    outcome = played[0]["node1"]["bad_stale"]
    assert outcome["failed"] is True and "heartbeat_stale must be 0 (off) or a positive" in outcome["msg"], outcome


def test_check_mode_returns_without_waiting(played):
    result = played[0]["node1"]["checked"]
    assert not result.get("failed"), result
    assert result["msg"] == "check mode: the barrier was not awaited"
    assert result["port"] is None and len(result["ports"]) == 3


def test_a_bad_port_range_fails_saying_what_is_expected(played):
    result = played[0]["node1"]["bad_range"]
    assert result["failed"] is True
    assert "port_range must be LOW-HIGH" in result["msg"]


def test_the_token_never_appears_in_output_even_at_vvv(played):
    output = played[1]
    assert "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER" in output  # -vvv printed the module's arguments, token masked
    assert TOKEN not in output


def test_each_node_returns_its_barrier_step_times_and_a_failed_wait_too(played):
    records = played[0]
    for node in ("node1", "node2"):
        step = records[node]["release"]["step"]
        assert step["name"] == "barrier" and step["start"] <= step["end"], step
    # A failed wait is timed as well: the rescue writes it into the node's status.json.
    failed = records["node1"]["rank0_timeout"]
    assert failed["failed"] is True and failed["step"]["end"] - failed["step"]["start"] > 0
    assert "step" not in records["node1"]["checked"]  # check mode waits for nothing and records nothing
