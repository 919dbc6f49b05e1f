#!/usr/bin/python
"""Ansible module: the facts of an allocation node that the pipeline needs."""

DOCUMENTATION = r"""
module: node_facts
short_description: Read what the pipeline needs to know about a node, and make its results directory
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Replaces Ansible fact gathering (which would copy the node's environment, secrets included) - checks Docker
    answers, detects the node's and the allocation's GPUs and creates the node dir, refusing job dirs another user
    owns or could write. Optionally removes stale containers and resolves rank 0's addresses.
options:
  node:
    description: The node's name in the allocation (the inventory host name).
    type: str
    required: true
  results_dir:
    description: The results directory, on storage shared by every node and the controller.
    type: path
    required: true
  job_id:
    description: The SLURM job ID (the job's directory name).
    type: str
    required: true
  attempt:
    description: The job's attempt (C(SLURM_RESTART_COUNT), 0 for its first run); each attempt has its own dir.
    type: int
    default: 0
  resolve_master:
    description: Resolve rank 0's routable addresses - on rank 0 its own host name, elsewhere O(master_host).
    type: bool
    default: false
  master_host:
    description:
      - Rank 0's host name, resolved with O(resolve_master) on another node (pull mode); empty - this node's own.
    type: str
    default: ""
  remove_stale_containers:
    description: Remove this user's containers whose run has ended (the C(stale_containers) module's rules).
    type: bool
    default: false
  container_runtime:
    description: What runs the containers; only C(docker) has a daemon to ask for its version.
    type: str
    default: docker
  read_by_preflight:
    description: What the preflight round already read on this node (C(node_preflight)'s C(node_facts)), returned as is.
    type: dict
version_added: "0.1.0"
author:
  - slurm-multi maintainers
attributes:
  check_mode:
    support: partial
    details:
      - Reads the node as a normal run does, and creates the node's results directory in check mode too
        (reported as no change), as the stages after it write there.
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Read the node's facts
  node_facts:
    node: "{{ inventory_hostname }}"
    results_dir: /shared/results
    job_id: "{{ slurm_job_id }}"
    resolve_master: "{{ node_rank == 0 }}"
    remove_stale_containers: true
  register: node
"""

RETURN = r"""
hostname:
  description: The node's hostname.
  returned: always
  type: str
  sample: gpu001
user:
  description: The user the run is executed as.
  returned: always
  type: str
  sample: alice
docker_version:
  description: The node's Docker daemon version; null under a runtime with no daemon (O(container_runtime)).
  returned: always
  type: str
  sample: 20.10.24+dfsg1
gpu_vendor:
  description: C(AMD), C(NVIDIA) or C(none).
  returned: always
  type: str
  sample: AMD
gpus:
  description: The node's GPUs as the gpu_facts module reports them.
  returned: always
  type: list
  elements: dict
allocated_gpus:
  description: GPU indices SLURM allocated to the job on this node, or null when SLURM set none.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
node_dir:
  description: The node's results directory.
  returned: always
  type: str
  sample: /shared/results/4242/attempt-0/nodes/gpu001
attempt_dir:
  description: The attempt's directory, shared by every node (its ABORT marker, build manifest, node dirs).
  returned: always
  type: str
  sample: /shared/results/4242/attempt-0
routable_addresses:
  description: Non-loopback IPv4 addresses of the hostname (with I(resolve_master)); loopback is never trusted.
  returned: always
  type: list
  elements: str
  sample: [10.1.0.11]
gpu_warnings:
  description: Why GPU detection found nothing, when it did not.
  returned: always
  type: list
  elements: str
stale_containers:
  description: With O(remove_stale_containers), the cleanup's result (as the C(stale_containers) module returns it).
  returned: when O(remove_stale_containers) is set
  type: dict
  sample: {"removed": ["slurm-multi-4100-r0"], "reasons": {"slurm-multi-4100-r0": "its SLURM job 4100 has ended"},
           "kept": []}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.facts import NODE_FACTS_OPTIONS, read_node


def run_module(module: AnsibleModule) -> None:
    """Read the node's facts and make its results directory; a node that cannot take part fails with why."""
    read = module.params["read_by_preflight"]
    if read is None:
        options = {name: module.params[name] for name in NODE_FACTS_OPTIONS}
        read = read_node(options, check_mode=module.check_mode)
    read = dict(read)
    for warning in read.pop("warnings", []):
        module.warn(warning)
    if read.pop("failed", False):
        module.fail_json(**read)
    module.exit_json(**read)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(NODE_FACTS_OPTIONS, read_by_preflight=dict(type="dict")),
        supports_check_mode=True,
    )
    run_reporting_unexpected_errors(module, run_module, "node_facts")


if __name__ == "__main__":
    main()
