DOCUMENTATION = r"""
name: slurm_allocation
short_description: The nodes of the current SLURM allocation, with their ranks
description:
  - Hosts are the allocation's nodes from C(SLURM_JOB_NODELIST), expanded with the python-hostlist library,
    in allocation order; the first is rank 0.
  - "Host variables: C(node_rank), C(ansible_connection) and C(ansible_python_interpreter); on the C(all) group,
    once for every node: C(nnodes), C(master_addr), C(master_port), C(slurm_job_id) and C(allocation_nodes)."
  - "Every host also gets the settings of the site file, the user's file and the settings' environment variables
    (docs/settings.md), which beat the playbook's group_vars and lose to C(-e); an unknown name fails the
    inventory. C(mode) is not given: whoever starts the playbook chose it."
  - Groups C(primary) (rank 0) and C(workers) (the others).
  - Outside an allocation it yields C(localhost) as a one-node run.
  - C(master_addr) is an explicit C(MASTER_ADDR) IP, else the site config's address for rank 0, else empty,
    and the preparation stage resolves it on rank 0 itself (a name resolving to loopback is not trusted).
  - C(master_port) is C(MASTER_PORT), else derived from the job ID so that two jobs sharing a node do not collide.
options:
  plugin:
    description:
      - Marks this file as this plugin's configuration, by the name ansible.cfg's C(enable_plugins) gives it
        (the full name where the collection is installed).
    required: true
    choices: [slurm_allocation, slurm_multi.pipeline.slurm_allocation]
  node_connection:
    description:
      - How the controller reaches the other nodes. The node the controller runs on always uses C(local).
      - C(srun) runs each task as a job step in the allocation (no SSH keys needed).
    type: str
    default: srun
    choices: [srun, ssh]
  python_interpreter:
    description:
      - Interpreter for modules on the nodes. Empty means the controller's own interpreter, which suits a
        checkout and venv on shared storage. Set it per site when nodes differ (modules need only python3 3.8+).
      - When empty and the controller's venv holds C(slurm-multi-module-python), that is the interpreter (the same
        Python, reading each pipelined module in blocks where CPython reads a script on stdin a byte per system call).
    type: str
    default: ""
  site_config:
    description:
      - "The site file (YAML; default: C(/etc/slurm-multi/site.yml)). C(node_addresses:) maps node names to the
        address that C(master_addr) takes when that node is rank 0; C(settings:) maps settings to the site's
        defaults for every job. The lab cluster writes one."
    type: path
    env:
      - name: SLURM_MULTI_SITE_CONFIG
"""

EXAMPLES = r"""
# slurm.yml beside ansible.cfg, for the installed collection (its inventory/slurm.yml); the checkout's
# inventory/slurm.yml names the plugin by its short name, slurm_allocation (ansible.cfg's inventory_plugins).
plugin: slurm_multi.pipeline.slurm_allocation
node_connection: srun
"""

import os
import socket
import sys

from ansible.errors import AnsibleParserError
from ansible.plugins.inventory import BaseInventoryPlugin

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import (
    CHOSEN_BY_THE_STARTER,
    SettingsError,
    read_settings,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    allocation_from_env,
)

# The srun connection by the name that finds it where this plugin was found: an installed collection's plugins have
# only their full name, a checkout's configured folders (ansible.cfg's connection_plugins) the short one too.
SRUN = "slurm_multi.pipeline.srun" if __name__.startswith("ansible_collections.") else "srun"


def module_python(executable=sys.executable):
    """The controller's Python for modules: through slurm-multi-module-python where pip put it beside it
    (the speed-up layer's, slurm_multi/speedup/)."""
    shim = os.path.join(os.path.dirname(executable), "slurm-multi-module-python")
    return shim if os.access(shim, os.X_OK) else executable


class InventoryModule(BaseInventoryPlugin):
    NAME = "slurm_allocation"

    def verify_file(self, path):
        return super().verify_file(path) and path.endswith((".yml", ".yaml"))

    def parse(self, inventory, loader, path, cache=True):
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        try:
            site = read_settings(os.environ, self.get_option("site_config"))
            allocation = allocation_from_env(os.environ, site.node_addresses)
        except (SettingsError, AllocationError) as exc:
            raise AnsibleParserError(f"slurm_allocation: {exc}") from None

        here = _this_node(allocation.nodes)
        interpreter = self.get_option("python_interpreter") or module_python()
        connection = SRUN if self.get_option("node_connection") == "srun" else self.get_option("node_connection")
        for group in ("primary", "workers"):
            inventory.add_group(group)
        for key, value in allocation.job_vars().items():
            inventory.set_variable("all", key, value)
        for node, rank in allocation.ranks().items():
            inventory.add_host(node, group="primary" if rank == 0 else "workers")
            inventory.set_variable(node, "node_rank", rank)
            inventory.set_variable(node, "ansible_python_interpreter", interpreter)
            local = node == here or allocation.nodes == ["localhost"]
            inventory.set_variable(node, "ansible_connection", "local" if local else connection)
            # Host vars, not the all group's: an inventory's group vars lose to the playbook's group_vars/all.
            for name, value in site.values.items():
                if name not in CHOSEN_BY_THE_STARTER:
                    inventory.set_variable(node, name, value)


def _this_node(nodes):
    """The allocation node the controller runs on (the batch host), if any."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return name if name in nodes else None
