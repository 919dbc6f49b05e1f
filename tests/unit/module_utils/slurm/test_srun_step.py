"""What a job step started by the srun connection sees, how srun's failures are read, and when a task is retried.

The classification tests use srun's own message text as srun 22.05 prints it (captured on the lab); the lab tests
run the real connection plugin through `ansible` inside `salloc`, once with a task that prints srun-like errors
and once with a real launch failure (a proxy in front of slurmctld slams srun's first connection shut).
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ansible.errors import AnsibleConnectionFailure
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import read_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.srun_step import (
    STEP_STARTED,
    is_transient_srun_error,
    read_step_result,
    step_command,
    step_environment,
    unreachable_reason,
)
from plugins.connection import srun as srun_connection
from tests.support.ansible import ansible_env

# srun 22.05's own words for failures before the step started (the lab, with the controller made unreachable).
LAUNCH_FAILURES = [
    "srun: error: Unable to confirm allocation for job 19: Zero Bytes were transmitted or received",
    "srun: error: Unable to confirm allocation for job 19: Socket timed out on send/recv operation",
    "srun: error: Unable to confirm allocation for job 19: Unable to contact slurm controller (connect failure)",
    "srun: error: Unable to confirm allocation for job 19: Connection reset by peer",
    "srun: error: Unable to create step for job 19: Job step creation temporarily disabled, retrying",
    "srun: error: Unable to create step for job 19: Resource temporarily unavailable",
]
STARTED = (STEP_STARTED + "\n").encode()


def _result(stderr, returncode=1, stdout=b""):
    return read_step_result(returncode, stdout, stderr.encode() if isinstance(stderr, str) else stderr)


def test_step_environment_keeps_the_allowlist_and_drops_secrets():
    env = {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C",
        "SLURM_JOB_ID": "5",
        "MAD_SECRETS_HFTOKEN": "s3cret",
        "AWS_SECRET_ACCESS_KEY": "x",
        "DOCKER_HOST": "unix:///elsewhere",
        "MAD_DOCKER_BUILDS": "/shared/c",
    }
    assert step_environment(env) == {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C",
        "SLURM_JOB_ID": "5",
        "MAD_DOCKER_BUILDS": "/shared/c",
    }


def test_extra_names_are_allowed_but_never_secrets():
    env = {"MY_SITE_VAR": "1", "MAD_SECRETS_X": "no"}
    assert step_environment(env, ["MY_SITE_*", "MAD_SECRETS_*"]) == {"MY_SITE_VAR": "1"}


def test_step_command_targets_one_node_of_the_job_and_overlaps():
    argv = step_command("42", "node2", "echo hi")
    assert argv[:7] == ["srun", "--jobid=42", "--overlap", "-N1", "-n1", "-w", "node2"]
    assert argv[-1] == "echo hi"  # the task's command is an argument of its own, never spliced into a script


def test_the_step_announces_its_start_before_the_command_runs():
    argv = step_command("42", "node2", "echo out; echo err >&2; exit 3")
    shell = argv[argv.index("/bin/sh") :]
    ran = subprocess.run(shell, capture_output=True)
    assert ran.returncode == 3 and ran.stdout == b"out\n"
    assert ran.stderr == STARTED + b"err\n"
    result = read_step_result(ran.returncode, ran.stdout, ran.stderr)
    assert result.started and result.stderr == b"err\n"


@pytest.mark.parametrize("stderr", LAUNCH_FAILURES)
def test_srun_launch_failures_before_the_step_started_are_transient(stderr):
    assert is_transient_srun_error(_result(stderr + "\n"))


@pytest.mark.parametrize("stderr", LAUNCH_FAILURES + ["Resource temporarily unavailable"])
def test_nothing_the_task_prints_after_it_started_makes_it_run_again(stderr):
    assert not is_transient_srun_error(_result(STARTED + stderr.encode() + b"\n"))


def test_a_task_printing_srun_like_errors_without_the_marker_is_not_transient_if_it_wrote_output():
    assert not is_transient_srun_error(_result(LAUNCH_FAILURES[0], stdout=b'{"changed": true}'))


def test_a_task_whose_own_stderr_names_the_error_without_srun_s_prefix_is_not_transient():
    assert not is_transient_srun_error(_result("OSError: [Errno 11] Resource temporarily unavailable\n"))


def test_a_task_exit_code_is_neither_transient_nor_unreachable():
    result = _result(STARTED + b"srun: error: node2: task 0: Exited with exit code 1\n")
    assert not is_transient_srun_error(result)
    assert unreachable_reason(result) is None


def test_a_node_outside_the_allocation_is_unreachable_with_srun_words():
    result = _result("srun: error: Unable to create step for job 9: Requested node configuration is not available\n")
    assert unreachable_reason(result) == "Requested node configuration is not available"
    assert not is_transient_srun_error(result)


def test_a_dead_node_is_unreachable():
    result = _result(
        "srun: error: Task launch for StepId=9.3 failed on node node3: Communication connection failure\n"
        "srun: error: Application launch failed: Communication connection failure\n"
    )
    assert "Communication connection failure" in unreachable_reason(result)


def test_a_task_printing_unreachable_words_is_not_a_lost_node():
    assert unreachable_reason(_result(STARTED + b"Communication connection failure\n")) is None


def test_only_the_first_marker_is_ours_and_removed():
    result = _result(STARTED + b"x\n" + STARTED)
    assert result.started and result.stderr == b"x\n" + STARTED


# --- the real plugin on the lab -----------------------------------------------------------------------------------


def _ansible_raw(command, tmp_path, env_in_allocation=(), ansible_options=()):
    """`ansible node1 -c srun -m raw -a COMMAND` inside `salloc -N1 -w node1`; env_in_allocation is set inside it."""
    ansible = Path(sys.executable).parent / "ansible"
    argv = [
        "salloc",
        "-N1",
        "-w",
        "node1",
        "--quiet",
        "env",
        *env_in_allocation,
        str(ansible),
        "node1",
        "-i",
        "node1,",
        "-c",
        "srun",
        *ansible_options,
        "-m",
        "raw",
        "-a",
        command,
    ]
    return subprocess.run(
        argv, cwd=Path(__file__).resolve().parents[4], env=ansible_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.lab
def test_a_task_runs_once_and_its_result_returns_whatever_the_retry_count(lab_cluster, tmp_path):
    # A retry count below zero means no retry: the task still runs, once.
    count = tmp_path / "executions"

    ran = _ansible_raw(
        f"echo ran >> {count}; echo the task said hello", tmp_path, ansible_options=["-e", "srun_retries=-1"]
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert count.read_text() == "ran\n"
    assert "the task said hello" in ran.stdout


@pytest.mark.lab
def test_a_task_that_prints_srun_s_transient_errors_runs_exactly_once(lab_cluster, tmp_path):
    count = tmp_path / "executions"
    command = (
        f"echo ran >> {count}; echo 'srun: error: Unable to create step for job 1: Resource temporarily "
        "unavailable' >&2; echo 'Resource temporarily unavailable' >&2; exit 1"
    )

    ran = _ansible_raw(command, tmp_path)

    assert ran.returncode != 0
    assert count.read_text() == "ran\n", ran.stdout + ran.stderr
    assert "Resource temporarily unavailable" in ran.stdout  # the task's own stderr reaches the user
    assert STEP_STARTED not in ran.stdout + ran.stderr  # the marker does not


class _SlammingProxy:
    """127.0.0.1:<port> -> slurmctld; the first `slam` connections are read and closed without an answer."""

    def __init__(self, target_port, slam):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.slam, self.connections = target_port, slam, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.connections <= self.slam:
                client.settimeout(5)
                try:
                    client.recv(65536)  # srun's request, left unanswered: "Zero Bytes were transmitted or received"
                except OSError:
                    pass
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def _slurm_conf_through(proxy, tmp_path):
    """A copy of the lab's SLURM config whose controller port is the proxy's."""
    conf_dir = tmp_path / "slurm"
    shutil.copytree("/etc/slurm", conf_dir)
    conf = conf_dir / "slurm.conf"
    lines = [line for line in conf.read_text().splitlines() if not line.startswith("SlurmctldPort=")]
    conf.write_text("\n".join([f"SlurmctldPort={proxy.port}", *lines]) + "\n")
    return conf


@pytest.mark.lab
@pytest.mark.fault
def test_a_real_srun_launch_failure_is_retried_and_the_task_runs_once(lab_cluster, tmp_path):
    proxy = _SlammingProxy(6817, slam=1)
    count = tmp_path / "executions"
    try:
        ran = _ansible_raw(f"echo ran >> {count}", tmp_path, [f"SLURM_CONF={_slurm_conf_through(proxy, tmp_path)}"])
    finally:
        proxy.close()

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "failed before the step started, retrying" in ran.stderr
    # Closing the connection reads on srun's side as either message, by timing: both are its own launch errors.
    assert re.search(
        r"srun: error: Unable to confirm allocation for job \d+: "
        r"(Zero Bytes were transmitted or received|Connection reset by peer)",
        ran.stderr,
    ), ran.stderr
    assert count.read_text() == "ran\n"


def _step_on_this_machine(command):
    """The step's own shell as srun starts it on a node (step_command's argv after srun's options), here."""
    argv = step_command("1", "node1", command)
    return argv[argv.index("/bin/sh") :]


def test_a_running_step_beats_on_stderr_and_its_task_keeps_its_output_and_exit_code():
    started = time.monotonic()
    ran = subprocess.run(
        _step_on_this_machine("echo out; printf partial >&2; sleep 6.5; echo ' line' >&2; exit 3"), capture_output=True
    )
    seconds = time.monotonic() - started
    assert ran.stderr.count(b"slurm-multi: srun step alive\n") >= 1, ran.stderr  # at 3 s (and 6 s, unless late)
    result = read_step_result(ran.returncode, ran.stdout, ran.stderr)
    assert (result.returncode, result.stdout, result.stderr, result.started) == (3, b"out\n", b"partial line\n", True)
    # A beat's sleep holding the output open would end the step at 9 s, with that sleep.
    assert seconds < 8, f"the step outlived its task by {seconds - 6.5:.1f} s"


def test_heartbeats_are_taken_out_of_the_tasks_stderr_wherever_they_fall():
    beat = b"slurm-multi: srun step alive\n"
    result = _result(STARTED + b"warn" + beat + b"ing: disk\n" + beat, returncode=0)
    assert result.stderr == b"warning: disk\n"


# srun 22.05's words for a node that died between two tasks (the lab, node3's address dropping every packet): the
# next step fails to launch after 12 s, before the step started.
DEAD_AT_LAUNCH = (
    "srun: error: Task launch for StepId=1750.0 failed on node node3: Communication connection failure\n"
    "srun: error: Application launch failed: Communication connection failure\n"
    "srun: Job step aborted\n"
)


def _srun_connection_to(node, attempt_dir, rank):
    connection = connection_loader.get("srun", PlayContext(), None)
    connection.set_options(
        direct={"remote_addr": node, "srun_abort_attempt_dir": str(attempt_dir), "node_rank": rank, "srun_retries": 0}
    )
    return connection


def test_a_node_that_cannot_launch_a_step_is_named_in_the_abort_marker(tmp_path, monkeypatch):
    """Not only a step gone silent: a node found dead at the next task's launch stops rank 0's barrier too (it waited
    out its 600 s timeout for a node Ansible had dropped)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text(f"#!/bin/sh\nprintf '%s' '{DEAD_AT_LAUNCH}' >&2\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1750")
    attempt_dir = tmp_path / "attempt"
    attempt_dir.mkdir()
    connection = _srun_connection_to("node3", attempt_dir, 2)
    with pytest.raises(AnsibleConnectionFailure, match="node node3 is unreachable through srun: .*Communication"):
        connection.exec_command("true")
    marker = read_abort_marker(str(attempt_dir))
    assert (marker["rank"], marker["node"]) == (2, "node3") and "Communication connection failure" in marker["reason"]


def test_a_started_step_gone_silent_is_killed_and_reported_as_a_dead_node(monkeypatch):
    monkeypatch.setattr(srun_connection, "STEP_SILENT_AFTER", 4)  # beats come every 3 s
    silent = ["/bin/sh", "-c", f"printf '%s\\n' '{STEP_STARTED}' >&2; exec sleep 60"]
    started = time.monotonic()
    assert srun_connection._run_step(silent, None, b"")[0] is None
    assert time.monotonic() - started < 8
    # A step that beats lives on, however long its task takes.
    returncode, stdout, _ = srun_connection._run_step(_step_on_this_machine("sleep 5; echo done"), None, b"")
    assert (returncode, stdout) == (0, b"done\n")
