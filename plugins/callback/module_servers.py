"""Callback: one module server per node of the allocation while a push-mode playbook runs."""

DOCUMENTATION = r"""
name: module_servers
type: aggregate
short_description: Start a module server on every node of the allocation for the playbook's srun tasks
description:
  - Push mode runs every task on a node as a module in a fresh Python there, 0.3 s of CPU each - most of it
    importing Ansible's module code - on every node for every task. When the first play with a host reached through
    the srun connection starts, this starts one srun step over the allocation's nodes, one task per node, running
    C(python -m slurm_multi.module_server); bin/slurm-multi-module-python then hands each pipelined module to its
    node's server, which runs it as a fork of a Python that imported Ansible once (0.02 s). The step is ended
    when the playbook ends (srun, sent SIGTERM, cancels it, which kills the servers).
  - Nothing is started outside an allocation or for plays without srun hosts (pull mode's node playbooks, the
    collect playbook); a module that finds no server (not up yet, or failed) runs in a fresh Python as before.
  - The step sees only the srun connection's allowlist of the environment (never C(MAD_SECRETS_*)); the server's
    modules take the environment of the task's own step. Prints nothing.
  - Before it starts the step, it puts a random key for this run in the playbook's environment
    (C(SLURM_MULTI_MODULE_SERVER_KEY)), which the servers' step and every task's step get (C(SLURM_MULTI_*) is in the
    allowlist). A server whose usual dir another user took first listens in a dir named with it, where the task's
    client finds it, and no other user can take that name first.
"""

import atexit
import os
import secrets
import subprocess
import sys

from ansible.plugins.callback import CallbackBase

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.srun_step import step_environment

# Seconds the servers' step gets to end after SIGTERM before it is killed.
STOP_WAIT = 5
# The run's key, the same name in slurm_multi/module_server.py and bin/slurm-multi-module-client.
SERVER_KEY = "SLURM_MULTI_MODULE_SERVER_KEY"


def module_servers_command(nodes: int) -> list:
    """srun's argv for the servers: one task on each of the allocation's nodes, beside the job's other steps."""
    return [
        "srun",
        "--overlap",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--quiet",
        "--mpi=none",
        sys.executable,
        "-m",
        "slurm_multi.module_server",
    ]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "module_servers"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._servers = None

    def v2_playbook_on_play_start(self, play):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if self._servers is not None or not os.environ.get("SLURM_JOB_ID") or not nodes:
            return
        inventory = play.get_variable_manager()._inventory
        hosts = inventory.get_hosts(play.hosts)
        if not any(host.vars.get("ansible_connection") in ("srun", "slurm_multi.pipeline.srun") for host in hosts):
            return
        # Set in this process before the play's tasks fork their workers: their srun steps take it from here.
        os.environ[SERVER_KEY] = secrets.token_hex(16)
        try:
            self._servers = subprocess.Popen(
                module_servers_command(int(nodes)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=step_environment(os.environ),
            )
        except (OSError, ValueError):
            self._servers = False  # no srun here: every module runs in a fresh Python
            return
        atexit.register(self._stop)

    def v2_playbook_on_stats(self, stats):
        self._stop()

    def _stop(self):
        servers = self._servers
        if not servers or servers.poll() is not None:
            return
        servers.terminate()
        try:
            servers.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            servers.kill()
            servers.wait()
