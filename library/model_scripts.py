#!/usr/bin/python
"""Ansible module: give each node its own copy of the model's scripts (logic in module_utils/model_scripts.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_scripts
short_description: Copy the model's scripts into each node's workspace, in one task for all nodes
extends_documentation_fragment:
  - module_attributes
description:
  - The running stage's copy of the model card's C(scripts) into a workspace of each node's own (a model writes
    into its working dir, and one node's writes must not be another's).
  - Runs once, on the controller (C(delegate_to=localhost), C(run_once)), for every node; the workspaces lie
    under the job's results dir, which every node sees. One task instead of one copy per node (Ansible's copy
    module walks a directory file by file, seconds per node).
  - A directory is copied whole and runs its C(run.sh); a file runs by name, its whole directory copied beside
    it. Modes, times and symlinks are kept, as C(cp -a) keeps them; files already in a workspace are replaced.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  scripts:
    description:
      - The model card's C(scripts), as a path on the controller (relative cards are resolved against the
        directory of C(models_file) by the caller).
    type: path
    required: true
  workspaces:
    description:
      - The workspace of every node (made when missing), e.g. C(<node dir>/workspace).
    type: list
    elements: path
    required: true
attributes:
  check_mode:
    support: full
    details:
      - Reports the copy it would make and copies nothing.
  diff_mode:
    support: none
notes:
  - Reports C(changed) whenever it copied (each run's workspace is fresh).
"""

EXAMPLES = r"""
- name: Give each node its own copy of the model's scripts
  model_scripts:
    scripts: "{{ running_models_file | dirname }}/{{ node_image.model_card.scripts }}"
    workspaces: "{{ allocation_nodes | map('extract', hostvars, 'running_workspace') | list }}"
  delegate_to: localhost
  run_once: true
  register: copied_scripts
"""

RETURN = r"""
source:
  description: The directory copied into each workspace.
  returned: always
  type: str
  sample: /shared/models/scripts/dummy
script:
  description: The script to run inside a workspace (C(run.sh) for a directory card).
  returned: always
  type: str
  sample: run_lastrank.sh
workspaces:
  description: The workspaces copied into (or, in check mode, that would be), in order.
  returned: always
  type: list
  elements: str
  sample: [/shared/results/4242/attempt-0/nodes/node1/workspace]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.model_scripts import ModelScriptsError, copy_scripts, scripts_source
from ansible.module_utils.module_runner import run_reporting_unexpected_errors

ARGUMENT_SPEC = dict(
    scripts=dict(type="path", required=True),
    workspaces=dict(type="list", elements="path", required=True),
)


def run_module(module: AnsibleModule) -> None:
    """Copy (or, in check mode, plan to copy) the model's scripts into every workspace."""
    workspaces = module.params["workspaces"]
    try:
        source, script = scripts_source(module.params["scripts"])
        if not module.check_mode:
            copy_scripts(source, workspaces)
    except ModelScriptsError as error:
        module.fail_json(msg=str(error), changed=False)
    module.exit_json(changed=bool(workspaces), source=source, script=script, workspaces=workspaces)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "model_scripts")


if __name__ == "__main__":
    main()
