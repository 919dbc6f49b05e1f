#!/usr/bin/python
"""Ansible module: a bounded diagnostics snapshot of a container (logic in module_utils/run/diagnostics.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: container_diagnostics
short_description: Take a bounded, non-fatal evidence snapshot of a model container
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - The snapshot M(run_model) takes of a failed, hung or cancelled container - its C(docker inspect) state and log
    tail; a running one's process table, listening sockets and O(log_dirs) log tails. Bounded and non-fatal (only
    failing to write O(dest) fails); variables by name only, O(redact_values) masked.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  container:
    description: Name or ID of the container.
    type: str
    required: true
  dest:
    description: File the snapshot is written to (e.g. the node's C(diagnostics.txt)); unset to only return it.
    type: path
  log_dirs:
    description: Dirs inside the container whose C(*.log) files' tails are taken (running containers only).
    type: list
    elements: str
    default: [/run_logs]
  redact_values:
    description: Secret values to mask wherever they appear in the snapshot.
    type: list
    elements: str
    default: []
  budget:
    description: Seconds the whole snapshot may take.
    type: float
    default: 15
  command_timeout:
    description: Seconds each command of the snapshot may take.
    type: float
    default: 5
  tail_lines:
    description: Lines kept from the end of each log.
    type: int
    default: 200
attributes:
  check_mode:
    support: full
    details:
      - The snapshot is taken (it only reads) and returned, but O(dest) is not written.
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Snapshot the model container of this node
  container_diagnostics:
    container: "slurm-multi-{{ slurm_job_id }}-r{{ node_rank }}"
    dest: "{{ results_dir }}/{{ slurm_job_id }}/nodes/{{ inventory_hostname }}/diagnostics.txt"
    log_dirs: [/run_logs, /myworkspace/logs]
"""

RETURN = r"""
diagnostics:
  description: The snapshot's text.
  returned: always
  type: str
  sample: "# slurm-multi diagnostics of container slurm-multi-4242-r1\n...\n== process table (ps -ef) ==\n..."
dest:
  description: Where the snapshot was written; null when O(dest) is unset or in check mode.
  returned: always
  type: str
  sample: /shared/results/4242/nodes/node2/diagnostics.txt
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import (
    collect_container_diagnostics,
    write_diagnostics,
)

ARGUMENT_SPEC = dict(
    container=dict(type="str", required=True),
    dest=dict(type="path"),
    log_dirs=dict(type="list", elements="str", default=["/run_logs"]),
    redact_values=dict(type="list", elements="str", default=[], no_log=True),
    budget=dict(type="float", default=15.0),
    command_timeout=dict(type="float", default=5.0),
    tail_lines=dict(type="int", default=200),
)


def run_module(module: AnsibleModule) -> None:
    """Take the snapshot, write it unless in check mode, and return it."""
    params = module.params
    text = collect_container_diagnostics(
        params["container"],
        log_dirs=params["log_dirs"],
        secret_values=params["redact_values"],
        budget=params["budget"],
        command_timeout=params["command_timeout"],
        tail_lines=params["tail_lines"],
    )
    if not params["dest"] or module.check_mode:
        module.exit_json(changed=bool(params["dest"]), diagnostics=text, dest=None)
    try:
        write_diagnostics(params["dest"], text)
    except OSError as error:
        module.fail_json(msg=f"cannot write the diagnostics to {params['dest']}: {error}", diagnostics=text)
    module.exit_json(changed=True, diagnostics=text, dest=params["dest"])


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "container_diagnostics")


if __name__ == "__main__":
    main()
