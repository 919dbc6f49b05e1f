#!/usr/bin/python
"""Ansible module: remove this user's model containers whose owner is known to be gone (logic in module_utils)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stale_containers
short_description: Remove this user's slurm-multi containers whose SLURM job has ended or whose owner is gone
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - The cleanup every job's preflight runs on each node (also for a site's epilogue) - removes this uid's
    slurm-multi containers whose SLURM job has ended, of an earlier attempt of this job, or started outside SLURM by
    a process that is gone; keeps everything else (docs/contracts.md, "Container naming").
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  user:
    description:
      - The user name that marks containers from before the owner labels as this user's (only reported); default - the
        current user.
    type: str
attributes:
  check_mode:
    support: full
    details:
      - Returns the containers it would remove, with why, and removes none.
  diff_mode:
    support: none
notes:
  - Needs C(squeue) on the node only when a container of a SLURM job other than a running one is present.
  - A job's own containers start after this cleanup runs in its preparation stage, so they are never in its way.
"""

EXAMPLES = r"""
- name: Remove this user's containers of runs that have ended
  stale_containers:
"""

RETURN = r"""
removed:
  description: Names of the containers removed (or, in check mode, that would be).
  returned: always
  type: list
  elements: str
  sample: ["slurm-multi-4100-r0"]
kept:
  description: This user's slurm-multi containers left in place, each with why.
  returned: always
  type: list
  elements: dict
  sample: [{"name": "slurm-multi-4242-r1", "reason": "its SLURM job 4242 is RUNNING"}]
reasons:
  description: Why each removed container was judged stale, by name.
  returned: always
  type: dict
  sample: {"slurm-multi-4100-r0": "its SLURM job 4100 has ended (CANCELLED)"}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import (
    current_user,
    remove_stale_containers,
)

ARGUMENT_SPEC = dict(
    user=dict(type="str"),
)


def run_module(module: AnsibleModule) -> None:
    """Remove (or, in check mode, list) the stale containers and report them."""
    try:
        cleanup = remove_stale_containers(module.params["user"] or current_user(), check_mode=module.check_mode)
    except DockerError as error:
        module.fail_json(msg=f"cannot clean up stale containers: {error}", changed=False)
    for warning in cleanup.warnings:
        module.warn(warning)
    module.exit_json(changed=bool(cleanup.removed), **cleanup.as_result())


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "stale_containers")


if __name__ == "__main__":
    main()
