#!/usr/bin/python
"""Ansible module: remove this user's containers of ended jobs (logic in module_utils/model_container.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stale_containers
short_description: Remove this user's slurm-multi containers whose SLURM job is no longer running
description:
  - The preparation stage's cleanup. Docker containers live outside SLURM's control, so a job killed hard
    (SIGKILL after KillWait, a node reboot of the controller) can leave its model container behind, holding
    GPUs that SLURM already gave to the next job.
  - Removes (C(docker rm -f)) the containers labelled C(slurm-multi.user=<user>) whose C(slurm-multi.job) label
    is not in O(running_job_ids). Containers of other users, and containers without those labels, are never touched.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  running_job_ids:
    description:
      - The user's running jobs, as SLURM_JOB_ID values - use C(squeue -h -o %A -u <user>), not C(%i), which
        prints array tasks as C(<array>_<task>) and would make their containers look stale.
      - Include the current job. An empty list removes every labelled container of the user on this node.
    type: list
    elements: str
    required: true
  user:
    description: Whose containers to consider (the C(slurm-multi.user) label). Defaults to the current user.
    type: str
notes:
  - Supports check mode - it returns the containers it would remove and removes none.
  - A job's own containers start after this cleanup runs in its preparation stage, so they are never in its way.
"""

EXAMPLES = r"""
- name: List the user's running jobs
  ansible.builtin.command: squeue -h -o %A -u "{{ ansible_user_id | default(lookup('env', 'USER')) }}"
  register: running_jobs
  changed_when: false

- name: Remove this user's containers of jobs that ended
  stale_containers:
    running_job_ids: "{{ running_jobs.stdout_lines + [slurm_job_id] }}"
"""

RETURN = r"""
removed:
  description: Names of the containers removed (or, in check mode, that would be).
  returned: always
  type: list
  elements: str
  sample: ["slurm-multi-4100-r0"]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.docker_cli import DockerError
from ansible.module_utils.model_container import current_user, remove_stale_containers
from ansible.module_utils.module_runner import run_reporting_unexpected_errors

ARGUMENT_SPEC = dict(
    running_job_ids=dict(type="list", elements="str", required=True),
    user=dict(type="str"),
)


def run_module(module: AnsibleModule) -> None:
    """Remove (or, in check mode, list) the stale containers and report them."""
    user = module.params["user"] or current_user()
    try:
        removed = remove_stale_containers(user, module.params["running_job_ids"], check_mode=module.check_mode)
    except DockerError as error:
        module.fail_json(msg=f"cannot clean up stale containers: {error}", changed=False)
    module.exit_json(changed=bool(removed), removed=removed)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "stale_containers")


if __name__ == "__main__":
    main()
