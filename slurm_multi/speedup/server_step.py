"""The module_servers callback's work (plugins/callback/module_servers.py is the file Ansible loads): at the first
play with srun hosts, one srun step over the allocation, a module server per node, ended with the playbook. The step
gets the srun connection's environment allowlist (never MAD_SECRETS_*) plus a random per-run SERVER_KEY, which names
the dir a server falls back to when another user took its usual one (docs/contracts.md, docs/speedup.md)."""

import atexit
import os
import secrets
import subprocess
import sys

from ansible.plugins.callback import CallbackBase

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.srun_step import step_environment
from slurm_multi.speedup.ansible_private import play_inventory
from slurm_multi.speedup.module_server import SERVER_KEY
from slurm_multi.speedup.switch import layer_on

# Seconds the servers' step gets to end after SIGTERM before it is killed.
STOP_WAIT = 5


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
        "slurm_multi.speedup.module_server",
    ]


class ModuleServers(CallbackBase):
    """The callback; plugins/callback/module_servers.py names it CallbackModule."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "module_servers"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        # On load: Ansible has read its command line, and no worker has forked yet.
        self._servers = None if layer_on() else False

    def v2_playbook_on_play_start(self, play):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if self._servers is not None or not os.environ.get("SLURM_JOB_ID") or not nodes:
            return
        hosts = play_inventory(play).get_hosts(play.hosts)
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
