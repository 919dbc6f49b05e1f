"""Callback: one module server per node of the allocation while a push-mode playbook runs. A part of the speed-up
layer: its code is slurm_multi/speedup/server_step.py (docs/speedup.md); this is the file Ansible loads."""

DOCUMENTATION = r"""
name: module_servers
type: aggregate
short_description: Start a module server on every node of the allocation for the playbook's srun tasks
description:
  - Part of slurm-multi's speed-up layer (docs/speedup.md; its code is slurm_multi/speedup/server_step.py). Starts
    nothing when the layer is off (the C(speedup) setting, or an ansible-core whose private names the layer uses
    changed).
  - Push mode runs every task on a node as a module in a fresh Python there, most of its CPU importing Ansible's
    module code, on every node for every task. When the first play with a host reached through the srun connection
    starts, this starts one srun step over the allocation's nodes, one task per node, running
    C(python -m slurm_multi.speedup.module_server); slurm-multi-module-python then hands each pipelined module to
    its node's server, which runs it as a fork of a Python that imported Ansible once. The step is ended when the
    playbook ends (srun, sent SIGTERM, cancels it, which kills the servers).
  - Nothing is started outside an allocation or for plays without srun hosts (pull mode's node playbooks, the
    collect playbook); a module that finds no server (not up yet, or failed) runs in a fresh Python.
  - The step sees only the srun connection's allowlist of the environment (never C(MAD_SECRETS_*)); the server's
    modules take the environment of the task's own step. Prints nothing.
  - Before it starts the step, it puts a random key for this run in the playbook's environment
    (C(SLURM_MULTI_MODULE_SERVER_KEY)), which the servers' step and every task's step get (C(SLURM_MULTI_*) is in the
    allowlist). A server whose usual dir another user took first listens in a dir named with it, where the task's
    client finds it, and no other user can take that name first.
"""

try:
    from slurm_multi.speedup.server_step import ModuleServers
except ImportError as missing:  # the layer is not in this Python (slurm-multi's package is not): plain Ansible
    from ansible.plugins.callback import CallbackBase as ModuleServers
    from ansible.utils.display import Display

    # The same words as preload_plugins.py's: Ansible shows one warning for both.
    Display().warning(
        f"slurm-multi's speed-up layer is not in this Python ({missing}); this playbook runs on plain Ansible "
        "(docs/speedup.md)"
    )


class CallbackModule(ModuleServers):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "module_servers"
    CALLBACK_NEEDS_ENABLED = True
