#!/usr/bin/python
"""Ansible module: the node's GPU vendor, its GPUs, and the GPUs SLURM allocated on it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Report the node's GPU vendor, its GPUs and the SLURM allocation's GPUs
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Runs the node's GPU tools (C(amd-smi), else C(rocm-smi), then C(nvidia-smi)) and reads the KFD topology and the
    allocation's GPUs (C(SLURM_STEP_GPUS), else C(SLURM_JOB_GPUS)).
  - A missing, failing or hanging tool gives vendor C(none) with warnings, never a failure; malformed SLURM GPU
    variables, or ones naming a GPU the node lacks, fail.
options:
  timeout:
    description:
      - Seconds each GPU tool may run before it is stopped and counted as failed.
    type: float
    default: 30
attributes:
  check_mode:
    support: full
    details:
      - Only reads, so check mode returns what a normal run does.
  diff_mode:
    support: N/A
    details:
      - Changes nothing, so there is nothing to diff.
notes:
  - Run it without fact gathering; it needs no facts.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
"""

EXAMPLES = r"""
- name: Find the node's GPUs and the allocation's share of them
  gpu_facts:
  register: node_gpus
"""

RETURN = r"""
gpu_vendor:
  description: C(AMD), C(NVIDIA), or C(none) when no usable GPU was found.
  returned: always
  type: str
  sample: AMD
gpus:
  description: The node's GPUs, in index order; empty when the vendor is C(none).
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: The tool's device index, the number SLURM's GPU variables use.
      type: int
      sample: 0
    name:
      description: Product name, when the tool reports one.
      type: str
      sample: AMD Instinct MI300X
    uuid:
      description: The GPU's unique id (AMD UUID or unique id, NVIDIA C(GPU-...) UUID), when known.
      type: str
      sample: d4ff74a1-0000-1000-80b1-dbb1e6a69543
    pci_bus:
      description: PCI address, lower case, 4-digit domain.
      type: str
      sample: "0000:11:00.0"
    arch:
      description: AMD graphics target (gfx name), when known.
      type: str
      sample: gfx942
    render_node:
      description: N of C(/dev/dri/renderD<N>) for an AMD GPU, from the KFD topology; null when unknown.
      type: int
      sample: 128
    mig_devices:
      description: MIG instances of an NVIDIA GPU in MIG mode (index, profile, uuid); empty otherwise.
      type: list
      elements: dict
      sample: []
allocated_gpus:
  description: GPU indices SLURM allocated on this node, sorted; null when SLURM set none.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
warnings:
  description: Why GPUs were not found or are only partly known (a tool missing, failing, unreadable output).
  returned: when there is something to warn about
  type: list
  elements: str
  sample: ["none of amd-smi, rocm-smi, nvidia-smi is on PATH, so no GPU was detected"]
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import allocated_gpu_indices, select_gpus
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.facts import VENDOR_NONE, detect_gpus
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors


def run_module(module: AnsibleModule) -> None:
    """Detect, check the allocation against what was found, and report."""
    if module.params["timeout"] <= 0:
        module.fail_json(msg=f"timeout must be a positive number of seconds, got {module.params['timeout']}")
    facts = detect_gpus(timeout=module.params["timeout"])
    for warning in facts["warnings"]:
        module.warn(warning)
    found = {"gpu_vendor": facts["vendor"], "gpus": facts["gpus"]}
    try:
        allocated = allocated_gpu_indices(os.environ)
        if allocated is not None and facts["vendor"] != VENDOR_NONE:
            select_gpus(allocated, facts["gpus"])
    except ValueError as error:
        module.fail_json(msg=str(error), **found)
    if allocated is not None and facts["vendor"] == VENDOR_NONE:
        module.warn(f"SLURM allocated GPU(s) {allocated} on this node, but no usable GPU was found on it")
    module.exit_json(changed=False, allocated_gpus=allocated, **found)


def main() -> None:
    module = AnsibleModule(argument_spec={"timeout": {"type": "float", "default": 30}}, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "gpu_facts")


if __name__ == "__main__":
    main()
