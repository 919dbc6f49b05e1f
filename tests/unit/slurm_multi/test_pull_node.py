"""slurm_multi/pull_node.py, pull mode's task on each node, with a stand-in for ansible-playbook: a process that dies
at the first SIGTERM, as ansible-playbook does, after starting a "run module" in a session of its own (as Ansible's
worker detaches) that needs a second to write its files when it is stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_multi.submission.sbatch import PULL_NODE_SCRIPT

PLAYBOOK = """
import json, os, signal, sys, time
out = sys.argv[1]
def publish(path, text):  # whole or not at all: the test reads a file as soon as it is there
    with open(path + ".tmp", "w") as file:
        file.write(text)
    os.rename(path + ".tmp", path)
module = os.fork()
if module == 0:
    os.setsid()
    def stopped(*_):
        time.sleep(1.0)  # the snapshot, the container's stop, the node's status
        open(out + ".done", "w").close()
        os._exit(0)
    signal.signal(signal.SIGTERM, stopped)
    publish(out + ".module", str(os.getpid()))
    while True:
        time.sleep(60)
publish(out + ".playbook",
        json.dumps({"pid": os.getpid(), "env": os.environ.get("SLURM_MULTI_PLAYBOOK_PID"), "argv": sys.argv[2:]}))
if len(sys.argv) > 2 and sys.argv[2] == "exit":
    sys.exit(3)
while True:
    time.sleep(60)
"""


def start(tmp_path, *args, node="node7"):
    script = tmp_path / "playbook.py"
    script.write_text(PLAYBOOK)
    out = tmp_path / "out"
    task = subprocess.Popen(
        [sys.executable, str(PULL_NODE_SCRIPT), sys.executable, str(script), str(out), *args],
        env=dict(os.environ, SLURMD_NODENAME=node),
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (Path(f"{out}.module").exists() and Path(f"{out}.playbook").exists()):
        assert time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.02)
    module = int(Path(f"{out}.module").read_text())
    return task, out, module


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stopped_task_exits_only_after_the_orphaned_run_module_wrote_its_files(tmp_path):
    task, out, module = start(tmp_path)
    # As SLURM stops a step: every process of it gets the signal, the task's process group and the detached module.
    os.killpg(task.pid, signal.SIGTERM)
    os.kill(module, signal.SIGTERM)
    rc = task.wait(timeout=30)
    # The task outlived the playbook (dead at once) until the module, adopted by it, was done: SLURM, which kills
    # what is left of a step once its task exits, finds nothing left to kill.
    assert Path(f"{out}.done").exists(), "the task exited before the run module wrote its files"
    assert not alive(module)
    assert rc == 128 + signal.SIGTERM  # the playbook's end, as a shell reports it


def test_the_playbook_gets_its_own_pid_and_this_nodes_limit(tmp_path):
    task, out, module = start(tmp_path, node="node7")
    seen = json.loads(Path(f"{out}.playbook").read_text())
    assert seen["env"] == str(seen["pid"])  # SLURM_MULTI_PLAYBOOK_PID: rank 0's heartbeat watches this process
    assert seen["argv"] == ["--limit", "node7"]
    os.killpg(task.pid, signal.SIGTERM)
    os.kill(module, signal.SIGTERM)
    task.wait(timeout=30)


def test_without_a_stop_the_task_ends_with_the_playbook_and_its_exit_code(tmp_path):
    task, out, module = start(tmp_path, "exit")
    try:
        # Not kept by the leftover process (here the module, which a finished run never leaves; the heartbeat
        # loop is the one that does, for up to 2 s): SLURM cleans up after the task, as before.
        assert task.wait(timeout=20) == 3
        assert alive(module)
    finally:
        os.kill(module, signal.SIGKILL)


def test_a_playbook_that_cannot_be_started_exits_127_saying_why(tmp_path):
    result = subprocess.run(
        [sys.executable, str(PULL_NODE_SCRIPT), str(tmp_path / "no-such-ansible-playbook")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 127
    assert "cannot run" in result.stderr and "no-such-ansible-playbook" in result.stderr, result.stderr
