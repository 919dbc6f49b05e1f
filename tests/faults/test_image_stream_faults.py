"""Faults of the streamed image transport on the lab (image_transport stream, chain node1 -> node2 -> node3), with a
fresh 250 MB image (a base of random bytes that only node1 holds, and a layer of the test's own) so the stream lasts
seconds:

* the sender killed mid-stream (rank 0's `docker save`): every worker's load is aborted, rank 0 writes the cache
  entry the plain way, the workers load it; the run succeeds and every node holds rank 0's image;
* the middle hop killed mid-stream (node2's image_stream module): the run fails naming node2; node3 loads the
  cache entry rank 0 wrote beside the stream; node2 holds no image;
* one byte corrupted on the wire between node2 and node3 (a relay of this test's on node2's address, on the port
  node2 would have listened on first; it flips one byte of what it passes): node3's load is aborted before the
  daemon registers anything, node3 loads the cache; the run succeeds.

In every case no node's daemon holds a half-loaded or foreign image: the model's tag names rank 0's image or
nothing. The processes killed are found by their SLURM_JOB_ID (this run's job) in /proc: nothing else is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream_protocol import derive_stream_ports
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import default_master_port
from tests.faults import FAULT_RUN_BOUND, run_job
from tests.support.lab_nodes import node_docker_host

pytestmark = [pytest.mark.lab, pytest.mark.fault]

ROOT = Path(__file__).resolve().parents[2]
NODES = ("node1", "node2", "node3")
# 250 MB of random bytes (the faults strike at 100 MB), built once on node1 alone: each test's image is this base
# plus a layer of its own, so rank 0's build takes a second while its image is still new to every worker (whose
# daemons never hold the base).
BALLAST = f"slurm-multi-test/streamfault-ballast:{uuid.uuid4().hex[:8]}"
BALLAST_BUILD = """FROM slurm-multi-lab/busybox:latest
RUN dd if=/dev/urandom of=/ballast bs=1M count=250
"""
MODEL_DOCKERFILE = """# CONTEXT {{'guest_os': 'UBUNTU'}}
# A large image for the streamed transport's fault tests (tests/faults/test_image_stream_faults.py).
FROM {ballast}
RUN echo {name} > /model-name
WORKDIR /myworkspace
"""


@pytest.fixture(scope="module")
def ballast(lab_cluster):
    """The 250 MB base, on node1's daemon for the module's tests, removed after them."""
    built = subprocess.run(
        ["docker", "--host", node_docker_host("node1"), "build", "--network=host", "-t", BALLAST, "-"],
        input=BALLAST_BUILD,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    yield BALLAST
    docker_on("node1", "rmi", "-f", BALLAST)


@pytest.fixture
def stream_zoo(tmp_path, ballast):
    """The sample models plus a 250 MB model of a name of this test's own (so its tag is this test's alone)."""
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    name = f"streamfault{uuid.uuid4().hex[:8]}"
    (zoo / "docker" / "streamfault.Dockerfile").write_text(MODEL_DOCKERFILE.format(ballast=ballast, name=name))
    cards = json.loads((zoo / "models.json").read_text())
    base = next(card for card in cards if card["name"] == "dummy")
    cards.append(dict(base, name=name, dockerfile="docker/streamfault", tags=[name]))
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo / "models.json", name


def docker_on(node, *args):
    return subprocess.run(
        ["docker", "--host", node_docker_host(node), *args], capture_output=True, text=True, timeout=120
    )


def image_of(node, reference):
    result = docker_on(node, "image", "inspect", "--format", "{{.Id}}", reference)
    return result.stdout.strip() if result.returncode == 0 else None


def job_processes(job_id):
    """(pid, ppid, argv, environment) of every process whose environment says it is part of SLURM job `job_id`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
            if env.get("SLURM_JOB_ID") != job_id:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found.append((int(entry), ppid, argv, env))
    return found


def docker_commands(job_id, verb, node=None):
    """This job's `docker <verb>` processes (on `node`, when given: its srun step's SLURMD_NODENAME)."""
    return [
        (pid, ppid, env)
        for pid, ppid, argv, env in job_processes(job_id)
        if os.path.basename(argv[0]) == "docker"
        and verb in argv[1:4]
        and (node is None or env.get("SLURMD_NODENAME") == node)
    ]


def this_job(results_dir, timeout=300.0):
    """The job ID of the run starting in `results_dir` (its job dir shows up in the preparation stage)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = (
            [p.name for p in results_dir.iterdir() if p.is_dir() and p.name.isdigit()] if results_dir.is_dir() else []
        )
        if jobs:
            return jobs[0]
        time.sleep(0.1)
    return None


class Fault(threading.Thread):
    """Runs `inject(job_id)` beside the run once the run's job exists; `done` says what it did (None: nothing)."""

    def __init__(self, results_dir, inject):
        super().__init__(daemon=True)
        self.results_dir = results_dir
        self.inject = inject
        self.done = None
        self.start()

    def run(self):
        job_id = this_job(self.results_dir)
        if job_id:
            self.done = self.inject(job_id)


def wait_for(condition, timeout=400.0, pause=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(pause)
    return None


def saved_bytes(cache_dir):
    """The size of rank 0's cache entry being written (its temporary tar), 0 while there is none."""
    try:
        return max([p.stat().st_size for p in Path(cache_dir).glob(".*.tar.tmp")] or [0])
    except OSError:
        return 0


def run_stream(tmp_path, zoo, inject, fallback_wait=120, heartbeat_stale=30):
    models_file, name = zoo
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    fault = Fault(results_dir, inject)
    run = run_job(
        results_dir,
        model_tags=[name],
        models_file=str(models_file),
        image_transport="stream",
        image_cache_dir=str(tmp_path / "image-cache"),
        image_stream_fallback_wait=fallback_wait,
        heartbeat_stale=heartbeat_stale,
    )
    fault.join(30)
    return run, fault.done


def figures(run):
    return {rank: json.loads((run.attempt_dir / f"image_stream.rank{rank}.json").read_text()) for rank in (1, 2)}


def rank0_image(run):
    manifest = json.loads((run.attempt_dir / "build_manifest.json").read_text())
    (entry,) = manifest["built_images"].values()
    return entry["docker_image"], entry["image_id"]


def assert_no_wrong_image(run, holders):
    """Each node in `holders` holds rank 0's image under its tag; every other node holds neither tag nor ID."""
    tag, image_id = rank0_image(run)
    for node in NODES:
        if node in holders:
            assert image_of(node, tag) == image_id, (node, image_of(node, image_id), docker_on(node, "images").stdout)
        else:
            assert image_of(node, tag) is None and image_of(node, image_id) is None, node


@pytest.fixture(autouse=True)
def forget_the_image(stream_zoo):
    yield
    _, name = stream_zoo
    for node in NODES:
        images = docker_on(node, "images", "-q", "--no-trunc", f"ci-{name}*").stdout.split()
        if images:
            docker_on(node, "rmi", "-f", *images)


# Every stream fault in both modes: the module is the same, but in pull mode it runs inside each node's own play,
# and the suite's coverage showed lines (the abort's way through the barrier, the load's digest check) that only the
# pull copies reached.
def test_the_sender_killed_mid_stream_ends_with_every_node_holding_rank0s_image(lab_cluster, tmp_path, stream_zoo):
    def kill_the_save(job_id):
        # Mid-stream: 100 of the 250 MB saved (the save waits for the chain: the stream is as far).
        if not wait_for(lambda: saved_bytes(tmp_path / "image-cache") > 100 << 20):
            return None
        saves = docker_commands(job_id, "save")
        for pid, _, _ in saves:
            os.kill(pid, signal.SIGKILL)
        return [pid for pid, _, _ in saves] or None

    run, killed = run_stream(tmp_path, stream_zoo, kill_the_save)
    assert killed, "no docker save of the run was found to kill"
    assert run.rc == 0, run.output[-4000:]
    assert run.record["status"] == "SUCCESS", run.record
    assert run.seconds < FAULT_RUN_BOUND
    for rank, got in figures(run).items():
        assert got["action_taken"] == "loaded-from-cache", (rank, got)
        assert "rank 0 could not stream" in got["stream_error"], got
    assert_no_wrong_image(run, NODES)


def test_the_middle_hop_killed_mid_stream_fails_naming_node2_and_node3_still_gets_the_image(
    lab_cluster, tmp_path, stream_zoo
):
    def kill_node2s_module(job_id):
        found = wait_for(lambda: saved_bytes(tmp_path / "image-cache") > 100 << 20)
        if not found or not docker_commands(job_id, "load", "node2"):
            return None
        (pid, module_pid, _), *_ = docker_commands(job_id, "load", "node2")
        if not any(p == module_pid for p, _, _, _ in job_processes(job_id)):
            return None  # not this job's: never kill what the run did not start
        os.kill(module_pid, signal.SIGKILL)
        return module_pid

    run, killed = run_stream(tmp_path, stream_zoo, kill_node2s_module)
    assert killed, "node2's image_stream module was not found to kill"
    assert run.rc != 0
    assert run.seconds < FAULT_RUN_BOUND
    record = run.record
    assert record["status"] == "FAILURE" and "node2" in record["reason"], record
    node3 = json.loads((run.attempt_dir / "image_stream.rank2.json").read_text())
    assert node3["action_taken"] == "loaded-from-cache", node3
    assert "rank 2 (node3)" in node3["stream_error"]
    assert_no_wrong_image(run, ("node1", "node3"))


def test_rank0s_module_killed_mid_stream_fails_naming_node1_without_waiting_out_the_fallback(
    lab_cluster, tmp_path, stream_zoo
):
    # Rank 0 itself gone: no cache entry will ever come. Its heartbeat stands still, so the workers give up after
    # heartbeat_stale (10 s here; default 30) instead of waiting image_stream_fallback_wait (300 s).
    killed_at = []

    def kill_rank0s_module(job_id):
        if not wait_for(lambda: saved_bytes(tmp_path / "image-cache") > 100 << 20):
            return None
        saves = docker_commands(job_id, "save", "node1")
        modules = {ppid for _, ppid, _ in saves} & {pid for pid, _, _, _ in job_processes(job_id)}
        for pid in modules:  # only this job's processes: the save's parent, rank 0's image_stream module
            os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        return sorted(modules) or None

    run, killed = run_stream(tmp_path, stream_zoo, kill_rank0s_module, fallback_wait=300, heartbeat_stale=10)
    assert killed, "rank 0's image_stream module was not found to kill"
    assert run.rc != 0
    assert time.monotonic() - killed_at[0] < 150, "the workers waited out the fallback wait"
    record = run.record
    assert record["status"] == "FAILURE" and "node1" in record["reason"], record
    for rank in (1, 2):
        got = json.loads((run.attempt_dir / f"image_stream.rank{rank}.json").read_text())
        assert "rank 0 (node1) died while writing the shared cache entry" in got["failed"], got
        assert "stood still for 10 s" in got["failed"], got  # the setting reached the wait
    assert_no_wrong_image(run, ("node1",))


class CorruptingRelay:
    """A relay on node2's address at the port node2 would listen on first: node2 then listens on the next
    candidate, node3 connects here first, and what passes from node2 to node3 has one byte flipped."""

    def __init__(self, address, port, next_port, flip_at=50_000_000):
        self.sock = socket.create_server((address, port))
        self.target = (address, next_port)
        self.flip_at = flip_at
        self.flipped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, source, sink, flip):
        passed = 0
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if flip and passed <= self.flip_at < passed + len(data):
                    data = bytearray(data)
                    data[self.flip_at - passed] ^= 0x40
                    self.flipped = True
                passed += len(data)
                sink.sendall(data)
        except OSError:
            pass
        for end in (sink, source):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.sock.close()


def test_one_corrupted_byte_between_hops_aborts_node3s_load_and_node3_loads_the_cache(
    lab_cluster, tmp_path, stream_zoo
):
    relays = []

    def corrupt_the_wire(job_id):
        ports = derive_stream_ports(default_master_port(job_id), job_id)
        relays.append(CorruptingRelay("127.0.0.12", ports[0], ports[1]))
        return True

    try:
        run, placed = run_stream(tmp_path, stream_zoo, corrupt_the_wire)
    finally:
        for relay in relays:
            relay.close()
    assert placed and relays[0].flipped, "the relay flipped no byte (the stream did not pass through it)"
    assert run.rc == 0, run.output[-4000:]
    assert run.record["status"] == "SUCCESS", run.record
    got = figures(run)
    assert got[1]["action_taken"] == "streamed", got
    assert got[2]["action_taken"] == "loaded-from-cache", got
    assert "does not match its trailer" in got[2]["stream_error"], got
    assert_no_wrong_image(run, NODES)
