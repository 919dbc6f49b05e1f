DOCUMENTATION = r"""
name: srun
short_description: Run tasks on a node of the current SLURM allocation as a job step
description:
  - Each task runs as C(srun --jobid=$SLURM_JOB_ID --overlap -N1 -n1 -w HOST /bin/sh -c CMD) with the module
    source piped over stdin (pipelining), so no SSH server or keys are needed on the nodes.
  - The step sees only an allowlist of the controller's environment variables; C(MAD_SECRETS_*) never reach it.
  - Transient srun failures (step creation refused, controller busy or unreachable) are retried with backoff, but
    only before the step started (it prints a marker on stderr first), so no task is ever run twice.
  - No time limit is put on a task, but a started step says it is alive on stderr every few seconds; one silent for
    C(STEP_SILENT_AFTER) is taken for a dead node (srun itself learns nothing of a node whose address drops every
    packet). A node reported unreachable, or one srun cannot launch a step on, is named in the attempt's ABORT
    marker once the run has its attempt dir, so the other nodes stop at once instead of waiting out their timeouts.
options:
  remote_addr:
    description: The node to run on (its SLURM node name).
    default: inventory_hostname
    type: str
    vars:
      - name: inventory_hostname
      - name: ansible_host
  srun_retries:
    description: How many times a transient srun failure from before the step started is retried.
    type: int
    default: 4
    vars:
      - name: srun_retries
  srun_abort_attempt_dir:
    description: The run's attempt dir, where a node found dead is named in the ABORT marker; empty before it has one.
    type: str
    default: ""
    vars:
      - name: srun_abort_attempt_dir
  node_rank:
    description: The node's rank, for the ABORT marker.
    type: int
    default: -1
    vars:
      - name: node_rank
  srun_extra_env:
    description: Names (a trailing C(*) matches a prefix) of further environment variables the step may see.
    type: list
    elements: str
    default: []
    vars:
      - name: srun_extra_env
"""

import contextlib
import itertools
import os
import shlex
import subprocess
import threading
import time

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import write_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.srun_step import (
    STEP_SILENT_AFTER,
    STEP_STARTED,
    is_transient_srun_error,
    read_step_result,
    step_command,
    step_environment,
    unreachable_reason,
)

display = Display()


class Connection(ConnectionBase):
    transport = "srun"
    has_pipelining = True

    def _connect(self):
        if not os.environ.get("SLURM_JOB_ID"):
            raise AnsibleConnectionFailure(
                "the srun connection needs a SLURM allocation: run inside `salloc`/`sbatch` (SLURM_JOB_ID is unset), "
                "or use ansible_connection=ssh"
            )
        self._connected = True
        return self

    def _srun(self, command, stdin_data=None):
        node = self.get_option("remote_addr")
        argv = step_command(os.environ["SLURM_JOB_ID"], node, command)
        env = step_environment(os.environ, self.get_option("srun_extra_env"))
        retries = self.get_option("srun_retries")
        for attempt in itertools.count():
            display.vvv(f"SRUN {node}: {argv[:-1]} <command>", host=node)
            returncode, stdout, stderr = _run_step(argv, env, stdin_data)
            if returncode is None:
                self._abort_run(
                    node,
                    f"its step sent nothing for {STEP_SILENT_AFTER} s (no heartbeat): the node or its network is down",
                )
            result = read_step_result(returncode, stdout, stderr)
            if not (is_transient_srun_error(result) and attempt < retries):
                break
            delay = min(2**attempt, 10)
            display.warning(
                f"srun to {node} failed before the step started, retrying in {delay}s: "
                f"{' '.join(result.srun_errors)[-200:]}"
            )
            time.sleep(delay)
        reason = unreachable_reason(result)
        if reason:
            self._abort_run(node, reason)
        return result.returncode, result.stdout, result.stderr

    def exec_command(self, cmd, in_data=None, sudoable=True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        return self._srun(cmd, in_data)

    def _abort_run(self, node, reason):
        """Fail the task with the node unreachable, named in the attempt's ABORT marker once the run has one: the run
        cannot succeed without it, and rank 0's barrier would otherwise wait out its timeout for a dropped node."""
        message = f"node {node} is unreachable through srun: {reason}"
        attempt_dir = self.get_option("srun_abort_attempt_dir")
        if attempt_dir and os.path.isdir(attempt_dir):
            write_abort_marker(attempt_dir, self.get_option("node_rank"), node, message)
        raise AnsibleConnectionFailure(message)

    def put_file(self, in_path, out_path):
        super().put_file(in_path, out_path)
        with open(in_path, "rb") as handle:
            rc, _, stderr = self._srun(f"cat > {shlex.quote(out_path)}", handle.read())
        if rc != 0:
            raise AnsibleError(
                f"copying {in_path} to {self.get_option('remote_addr')}:{out_path} failed: "
                f"{stderr.decode(errors='replace')}"
            )

    def fetch_file(self, in_path, out_path):
        super().fetch_file(in_path, out_path)
        rc, stdout, stderr = self._srun(f"cat {shlex.quote(in_path)}")
        if rc != 0:
            raise AnsibleError(
                f"fetching {self.get_option('remote_addr')}:{in_path} failed: {stderr.decode(errors='replace')}"
            )
        with open(out_path, "wb") as handle:
            handle.write(stdout)

    def close(self):
        self._connected = False


def _run_step(argv, env, stdin_data):
    """srun's (returncode, stdout, stderr); returncode None when its step, once started, went silent (then killed)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    stdout, stderr = bytearray(), bytearray()
    heard = [time.monotonic()]

    def drain(stream, into):
        for chunk in iter(lambda: stream.read1(65536), b""):
            into += chunk
            heard[0] = time.monotonic()

    def feed():
        with contextlib.suppress(BrokenPipeError), proc.stdin:  # srun ended first: its exit says why
            proc.stdin.write(stdin_data or b"")

    threads = [threading.Thread(target=feed, daemon=True)]
    threads += [
        threading.Thread(target=drain, args=pair, daemon=True)
        for pair in ((proc.stdout, stdout), (proc.stderr, stderr))
    ]
    for thread in threads:
        thread.start()
    started = STEP_STARTED.encode()
    while True:
        try:
            proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            # The clock runs from the step's start: srun may wait long for a step's resources before it.
            if started in stderr and time.monotonic() - heard[0] > STEP_SILENT_AFTER:
                proc.kill()
                proc.wait()
                return None, bytes(stdout), bytes(stderr)
    for thread in threads:
        thread.join()
    return proc.returncode, bytes(stdout), bytes(stderr)
