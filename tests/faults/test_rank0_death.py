"""Rank 0 killed once its image is out ends every worker within 30 s of its death, the record naming rank 0.

Rank 0 dies by a process kill of this job's own processes (SIGKILL, as the OOM killer would), at three moments:
(a) a worker on its way to the barrier, (b) a worker waiting for GO at the barrier, (c) the model running. One 3-node
job per mode holds (a) and (b): node3 is held on its way to the barrier (stopped), node2 waits for GO (rank 0 waits
for node3), then rank 0 dies and node3 goes on. A 2-node job per mode holds (c).

What dies is what a user's failure would kill on rank 0:
pull mode  rank 0's ansible-playbook (pid from its heartbeat file). Its barrier or run module lives on, orphaned;
           the workers find its playbook heartbeat standing still, and the orphan finds it too (it stops, and writes
           the ABORT marker in rank 0's name).
push mode  rank 0's module process on node1 (the barrier module, then the run module), found by its job's
           SLURM_JOB_ID in node1's processes. The controller sees that task fail at once, but acts only once every
           node's task is done: the workers would wait for GO until the barrier's timeout (600 s), or in the model
           until its own. Rank 0's modules beat module.alive, and the workers find it standing still.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults import _descendants, job_ids, node_processes, run_job
from tests.support.ansible import ROOT
from tests.support.lab.per_mode_jobs import both_modes_at_once

pytestmark = [pytest.mark.lab, pytest.mark.fault]

# Shorter than the default 30 s, so the test waits less; the reasons' figures show the setting reached the nodes.
HEARTBEAT_STALE = 10
# Every worker must have ended this soon after rank 0's death.
BOUND = 30
RANK0_ADDRESS = "127.0.0.11"  # node1's (slurm_multi.lab.cluster.LabNode)
SLEEPER = 'echo "sleeper: rank ${NODE_RANK} runs"\nsleep 300\n'


@dataclass
class Death:
    """One job in which rank 0 was killed: the run, and when each worker ended, in seconds after the death."""

    run: object
    ended: dict = field(default_factory=dict)


class _Job:
    """One pipeline run of this test in a thread, and what the test reads of it while it runs."""

    def __init__(self, base: Path, **job):
        self.results = base / "results"
        self._ran = {}
        self._thread = threading.Thread(
            target=lambda: self._ran.update(run=run_job(self.results, heartbeat_stale=HEARTBEAT_STALE, **job))
        )
        self._thread.start()

    def wait(self, what, predicate, timeout=240, every=0.01):
        """What `predicate()` returned once true; an error after `timeout` s, or once the job ended without it."""
        deadline = time.monotonic() + timeout
        while True:
            found = predicate()
            if found:
                return found
            ended = not self._thread.is_alive()
            output = self._ran["run"].output[-5000:] if "run" in self._ran else ""
            assert time.monotonic() < deadline and not ended, f"gave up waiting for {what}: {output}"
            time.sleep(every)

    def file(self, *parts: str) -> Path | None:
        """A file of the job's attempt dir, once it exists."""
        jobs = job_ids(self.results)
        path = self.results / sorted(jobs)[0] / "attempt-0" / Path(*parts) if jobs else None
        return path if path and path.exists() else None

    def ended(self, died: float, nodes, limit: float = 120) -> dict:
        """{node: seconds from `died` until it wrote its status.json}, watched together for `limit` s at most (a
        node still going then is left out: the tests say so)."""
        seconds = {}
        while len(seconds) < len(nodes) and time.monotonic() - died < limit:
            for node in nodes:
                if node not in seconds and self.file("nodes", node, "status.json"):
                    seconds[node] = round(time.monotonic() - died, 1)
            time.sleep(0.1)
        return seconds

    def log_says(self, node: str, text: str) -> bool:
        log = self.file("nodes", node, "run.log")
        return bool(log) and text in log.read_text(errors="replace")

    def playbook_pid(self, node: str) -> int:
        """Pull mode: the pid of `node`'s ansible-playbook, from its heartbeat file."""
        beat = self.wait(f"{node}'s playbook heartbeat", lambda: self.file("nodes", node, "playbook.alive"))
        return int(beat.read_text().split()[0])

    @property
    def slurm_job_id(self) -> str:
        return self.wait("the job's dir", lambda: sorted(job_ids(self.results)))[0].split(".")[0]

    def cancel(self) -> None:
        """End the job at once when the test broke down midway (its barrier would wait 600 s)."""
        if job_ids(self.results):
            subprocess.run(["scancel", self.slurm_job_id], capture_output=True)

    def join(self):
        self._thread.join(600)
        return self._ran["run"]


def _zoo(base: Path) -> Path:
    zoo = base / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "scripts" / "dummy" / "sleeper.sh").write_text(SLEEPER)
    cards = json.loads((zoo / "models.json").read_text())
    sleeper = dict(cards[0], name="sleeper", scripts="scripts/dummy/sleeper.sh", tags=["sleeper"])
    (zoo / "models.json").write_text(json.dumps(cards + [sleeper]))
    return zoo / "models.json"


def _job_pythons(node: str, slurm_job_id: str) -> set:
    """The Python processes of this job's steps on lab node `node` (push mode: the modules of its tasks)."""
    found = set()
    for pid in node_processes(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            executable = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if executable.startswith("python") and f"SLURM_JOB_ID={slurm_job_id}".encode() in environ:
            found.add(pid)
    return found


def _module_server(node: str, slurm_job_id: str):
    """Push mode: the pid of the job's module server on `node` (slurm_multi/speedup/module_server.py), or None. Its
    forks (one per module) carry its command line too; the server is the one whose parent is not one of them."""
    mark = b"slurm_multi.speedup.module_server"
    servers = {pid for pid in _job_pythons(node, slurm_job_id) if mark in _read(f"/proc/{pid}/cmdline")}
    return next((pid for pid in servers if _parent(pid) not in servers), None)


def _children(pid: int) -> list:
    return _read(f"/proc/{pid}/task/{pid}/children").split()


def _parent(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else -1


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _connected_to_rank0(pids: set) -> set:
    """Those of `pids` that hold an established TCP connection to rank 0's address (its barrier, here)."""
    sockets = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    sockets[link[8:-1]] = pid
        except OSError:
            continue
    rank0 = "".join(f"{int(octet):02X}" for octet in reversed(RANK0_ADDRESS.split(".")))
    connected = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and fields[2].startswith(rank0 + ":") and fields[9] in sockets:
            connected.add(sockets[fields[9]])
    return connected


def _signal(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _rank0_killed_at_the_barrier(mode: str, base: Path) -> Death:
    """(a) and (b): node3 held on its way to the barrier, node2 waiting for GO, then rank 0 killed."""
    cache = base / "cache"
    cache.mkdir(mode=0o755)
    job = _Job(base, mode=mode, nodelist="node[1-3]", model_tags=["dummy"], image_cache_dir=str(cache))
    death = Death(None)
    held = set()
    try:
        if mode == "pull":
            # Rank 0 announced its image: node3 is loading it, on its way to the barrier. Stopping its playbook holds
            # it there; its heartbeat (a process of its own) goes on, so no one takes it for dead.
            job.wait("rank 0's announcement", lambda: job.file("image.json"))
            rank0, held = job.playbook_pid("node1"), {job.playbook_pid("node3")}
            _signal(held, signal.SIGSTOP)
            node2 = job.playbook_pid("node2")
            job.wait("node2 waiting for GO", lambda: _connected_to_rank0(_descendants(node2)), every=0.1)
            time.sleep(0.5)  # its READY is sent milliseconds after it connects
            _signal({rank0}, signal.SIGKILL)
            died = time.monotonic()
            death.ended = job.ended(died, ["node2"])
            # node3 goes on once the orphaned rank-0 barrier gave up (its marker), else it might still release it.
            job.wait("rank 0's ABORT marker", lambda: job.file("ABORT"), 60, 0.1)
            _signal(held, signal.SIGCONT)
            death.ended.update(job.ended(died, ["node3"]))
        else:
            # Lockstep: rank 0 publishes and announces while the workers wait and load (one task), then every node
            # starts its run module, whose first step is the barrier. Every module on node3 runs in a fork of its
            # module server, and a fork serves its client to its end on its own: the server stopped while it serves
            # node3's load lets that load end and holds node3's run module before it starts. The load's fork is the
            # one alive at the announcement, or the first after it (node3's run cannot start before its load ended);
            # a load of an image node3 holds ends 50 ms after the announcement, so no later look can tell.
            server = job.wait("node3's module server", lambda: _module_server("node3", job.slurm_job_id))
            job.wait("rank 0's announcement", lambda: job.file("image.json"), every=0.002)
            job.wait("node3's load served", lambda: _children(server), every=0.001)
            held = {server}
            _signal(held, signal.SIGSTOP)
            job.wait("node2 waiting for GO", lambda: _connected_to_rank0(_job_pythons("node2", job.slurm_job_id)))
            time.sleep(0.5)  # its READY is sent milliseconds after it connects
            rank0 = _job_pythons("node1", job.slurm_job_id)  # rank 0's barrier module, which node2 reached
            _signal(rank0, signal.SIGKILL)
            died = time.monotonic()
            _signal(held, signal.SIGCONT)  # no orphaned rank 0 here: node3 goes on at once
            death.ended = job.ended(died, ["node2", "node3"])
    except BaseException:
        job.cancel()
        raise
    finally:
        _signal(held, signal.SIGCONT)  # never leave a node held
        death.run = job.join()
    return death


def _rank0_killed_in_the_run(mode: str, base: Path) -> Death:
    """(c): both containers run the sleeping model, then rank 0 is killed."""
    job = _Job(base, mode=mode, nodes=2, nodelist="node[1-2]", models_file=str(_zoo(base)), model_tags=["sleeper"])
    death = Death(None)
    try:
        for node in ("node1", "node2"):
            job.wait(f"{node}'s model running", lambda n=node: job.log_says(n, "sleeper: rank"), every=0.2)
        if mode == "pull":
            _signal({job.playbook_pid("node1")}, signal.SIGKILL)
        else:
            _signal(_job_pythons("node1", job.slurm_job_id), signal.SIGKILL)  # rank 0's run module
        died = time.monotonic()
        death.ended = job.ended(died, ["node2"])
    except BaseException:
        job.cancel()
        raise
    finally:
        death.run = job.join()
    if mode == "push":
        # Rank 0's run module was killed: nothing of ours lived on node1 to stop its container.
        _remove_containers("node1", death.run.job_id)
    return death


def _remove_containers(node: str, job_id: str) -> None:
    from slurm_multi.lab import cluster as lab

    docker = ["docker", "-H", f"unix://{lab.LabNode(int(node[4:])).docker_socket}"]
    listed = subprocess.run(
        [*docker, "ps", "-aq", "--filter", f"label=slurm-multi.job={job_id}"], capture_output=True, text=True
    )
    if listed.stdout.split():
        subprocess.run([*docker, "rm", "-f", *listed.stdout.split()], capture_output=True)


@pytest.fixture(scope="module")
def rank0_deaths(lab_cluster, tmp_path_factory):
    """mode -> {"barrier": Death (node2: b, node3: a), "run": Death (node2: c)}; both modes side by side."""

    def run_in(mode):
        started = time.monotonic()
        made = {
            "barrier": _rank0_killed_at_the_barrier(mode, tmp_path_factory.mktemp(f"rank0-barrier-{mode}")),
            "run": _rank0_killed_in_the_run(mode, tmp_path_factory.mktemp(f"rank0-run-{mode}")),
        }
        made["seconds"] = time.monotonic() - started
        print(f"rank 0 deaths, {mode} mode: {made['seconds']:.0f} s; ended after the death: "
              f"{ {key: made[key].ended for key in ('barrier', 'run')} }")  # fmt: skip
        return made

    return both_modes_at_once(run_in, output=lambda made: made["barrier"].run.output)


def _blames_rank0(run, workers):
    for node in workers:
        status = run.status(node)
        assert status["aborted_by_rank"] == 0, (node, status)
        assert "rank 0 (node1)" in status["reason"] and "heartbeat" in status["reason"], (node, status["reason"])
    record = run.record
    assert record["status"] == "FAILURE" and run.rc != 0
    assert record["reason"].startswith("node1 (rank 0): "), record["reason"]
    assert "stopped because rank 0 failed" in record["reason"], record["reason"]


def test_a_worker_on_its_way_to_the_barrier_ends_within_30_s_of_rank0s_death_naming_rank0(rank0_deaths, pipeline_mode):
    death = rank0_deaths(pipeline_mode)["barrier"]
    assert death.ended["node3"] < BOUND, death.ended
    _blames_rank0(death.run, ["node3"])


def test_a_worker_waiting_for_go_ends_within_30_s_of_rank0s_death_naming_rank0(rank0_deaths, pipeline_mode):
    death = rank0_deaths(pipeline_mode)["barrier"]
    assert death.ended["node2"] < BOUND, death.ended
    _blames_rank0(death.run, ["node2"])
    assert "stopped its heartbeat" in death.run.status("node2")["reason"]


def test_a_worker_running_the_model_ends_within_30_s_of_rank0s_death_naming_rank0(rank0_deaths, pipeline_mode):
    death = rank0_deaths(pipeline_mode)["run"]
    assert death.ended["node2"] < BOUND, death.ended
    _blames_rank0(death.run, ["node2"])
    assert death.run.status("node2")["exit_code"] is not None  # its container ran, and was stopped
