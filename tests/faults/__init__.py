"""Fault injection on the lab cluster: what the pipeline does when a node, a daemon, a port or an input goes wrong.

The helpers here are shared by the fault test modules: a finished successful job to put in each module's results
dir (its record and perf.csv row must survive every fault), a way to find the job a run created, the containers a
job left on the nodes, and short fault windows on one lab daemon that always end with the lab repaired.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.lab.pipeline import run_pipeline

NODES = ("node1", "node2", "node3")
# The nodes a fault run names: its checks name node1 as rank 0, and on a grown lab running jobs side by side, SLURM
# could place a 3-node job on node4.. instead.
NODELIST = "node[1-3]"
# Every fault must end a run within this many seconds (a healthy dummy run takes about a minute here).
FAULT_RUN_BOUND = 240
_BASELINE = {}


@dataclass
class JobRun:
    """One pipeline run in a results dir that may hold other jobs: its own job's record, statuses and timing."""

    rc: int
    output: str
    results_dir: Path
    job_id: str | None
    seconds: float

    @property
    def job_dir(self) -> Path:
        return self.results_dir / self.job_id

    @property
    def attempt_dir(self) -> Path:
        """The job's first (and, without a requeue, only) attempt."""
        return self.job_dir / "attempt-0"

    @property
    def record(self) -> dict:
        return json.loads((self.results_dir / "records" / f"{self.job_id}.json").read_text())

    def status(self, node: str) -> dict:
        return json.loads((self.attempt_dir / "nodes" / node / "status.json").read_text())


def job_ids(results_dir: Path) -> set:
    """The job IDs that have a directory in `results_dir`."""
    if not results_dir.exists():
        return set()
    return {p.name for p in results_dir.iterdir() if p.is_dir() and p.name != "records"}


def run_job(results_dir: Path, **extra_vars) -> JobRun:
    """Run the real pipeline once in `results_dir` (which may hold earlier jobs) and name the job it created."""
    before = job_ids(results_dir)
    started = time.monotonic()
    run = run_pipeline(results_dir, **extra_vars)
    seconds = time.monotonic() - started
    created = sorted(job_ids(results_dir) - before)
    return JobRun(run.rc, run.output, results_dir, created[-1] if created else None, seconds)


def perf_rows(results_dir: Path) -> list:
    """perf.csv's rows as dicts."""
    with open(results_dir / "perf.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def job_containers(job_id: str) -> list:
    """Names of the job's containers on any lab node's daemon, running or not."""
    out = subprocess.run(
        [
            "srun",
            "-N3",
            "--quiet",
            "docker",
            "ps",
            "-a",
            "--filter",
            f"label=slurm-multi.job={job_id}",
            "--format",
            "{{.Names}}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def successful_baseline(scratch: Path) -> JobRun:
    """A finished successful `dummy` job, run once per session; each module copies it into its own results dir."""
    if "run" not in _BASELINE:
        run = run_job(scratch / "baseline-results", model_tags=["dummy"])
        assert run.rc == 0, run.output[-3000:]
        _BASELINE["run"] = run
    return _BASELINE["run"]


def results_dir_with_baseline(scratch: Path, destination: Path) -> tuple:
    """`destination`: a results dir holding a copy of the successful baseline job; (its job ID, its perf row)."""
    baseline = successful_baseline(scratch)
    shutil.copytree(baseline.results_dir, destination)
    (row,) = perf_rows(destination)
    return baseline.job_id, row


def assert_earlier_job_intact(results_dir: Path, job_id: str, row: dict) -> None:
    """The earlier job's record is still there and its perf.csv row is unchanged."""
    record = json.loads((results_dir / "records" / f"{job_id}.json").read_text())
    assert record["status"] == "SUCCESS", record
    rows = perf_rows(results_dir)
    assert row in rows, rows


# --- short fault windows on one lab daemon -------------------------------------------------------------------------


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # a zombie is gone for our purpose: it no longer serves anything
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (OSError, IndexError):
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} did not stop within {timeout}s")


def restore_lab() -> None:
    """Bring every lab daemon back (idempotent; a restarted dockerd gets its socket bound again)."""
    from slurm_multi.lab import cluster as lab

    lab.up(3, progress=lambda message: None)


@contextlib.contextmanager
def lab_daemon_stopped(node: str, daemon: str):
    """Stop one lab node's `daemon` ("dockerd" or "slurmd") by the pid in the lab's pid file; restore the lab after."""
    from slurm_multi.lab import cluster as lab

    pid = lab.running_pid(f"{node}-{daemon}", daemon)
    assert pid is not None, f"{node}'s {daemon} is not running: the lab is not up"
    try:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid, 40)
        yield pid
    finally:
        restore_lab()


@contextlib.contextmanager
def address_dropped(address: str):
    """Drop every packet to a loopback `address`, as a dead node would; the rule is deleted afterwards."""
    assert address.startswith("127."), "faults are injected on loopback addresses only"
    rule = ["INPUT", "-d", address, "-j", "DROP"]
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True)


def _descendants(pid: int) -> set:
    """`pid` and every process under it."""
    children = {}
    # Listed, then read one by one: a process may end between the two (pathlib's glob of */stat raises then).
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        found.add(todo[-1])
        todo.extend(children.get(todo.pop(), []))
    return found


def _uts_namespace(pid: int):
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


def node_processes(node: str) -> list:
    """The pids of what runs on lab node `node` besides its namespace holder and its Docker daemon: its slurmd, the
    job steps' slurmstepd and every process of theirs (each node is a UTS namespace; a container has its own)."""
    from slurm_multi.lab import cluster as lab

    holder = lab.running_pid(f"{node}-holder", "sleep")
    dockerd = lab.running_pid(f"{node}-dockerd", "dockerd")
    assert holder and dockerd, f"{node} is not up: the lab is not running"
    spared = {holder} | _descendants(dockerd)
    namespace = _uts_namespace(holder)
    return sorted(
        int(proc.name)
        for proc in Path("/proc").glob("[0-9]*")
        if int(proc.name) not in spared and _uts_namespace(int(proc.name)) == namespace
    )


@contextlib.contextmanager
def node_killed(node: str, job_id: str):
    """Lab node `node` dies as a host does: every packet to its address dropped, and at once SIGKILLed its slurmd,
    its job steps and all their processes, and the job's containers on its daemon. Afterwards the node comes back
    (the address open, slurmd started again) - within the lab's SlurmdTimeout (60 s) of its death, or SLURM would
    mark it DOWN and kill the jobs of others on it."""
    from slurm_multi.lab import cluster as lab

    lab_node = lab.LabNode(int(node.removeprefix("node")))
    try:
        with address_dropped(lab_node.address):
            killed = node_processes(node)
            for pid in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            docker = ["docker", "-H", f"unix://{lab_node.docker_socket}"]
            listed = [*docker, "ps", "-q", "--filter", f"label=slurm-multi.job={job_id}"]
            containers = subprocess.run(listed, capture_output=True, text=True, check=True).stdout.split()
            if containers:
                subprocess.run([*docker, "kill", *containers], capture_output=True, check=True)
            yield killed
    finally:
        restore_lab()
