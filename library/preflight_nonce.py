#!/usr/bin/python
"""Ansible module: write the run's preflight nonce into every shared dir (logic in module_utils/node/preflight.py);
the pipeline runs its action plugin of the same name on the controller."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: preflight_nonce
short_description: Write the run's preflight nonce into the directories every node must share
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Push mode's controller writes a fresh nonce into each shared directory before any node runs its checks; each
    node's C(node_preflight) reads it back, which proves that it sees the same storage (in pull mode rank 0's
    C(node_preflight) writes it). Nonce files older than a day are pruned from the image cache.
version_added: "0.2.0"
author:
  - slurm-multi maintainers
options:
  nonce:
    description: The run's nonce.
    type: str
    required: true
  shared_dirs:
    description:
      - The directories to write it into, each C({name, path, nonce_file}) (the C(preflight_shared_dirs) filter's).
    type: list
    elements: dict
    required: true
  results_dir:
    description: The results dir the attempt dir lies under (its ownership is checked before anything is made).
    type: path
    required: true
attributes:
  check_mode:
    support: full
    details:
      - Writes nothing and reports the files it would write. The preflight role runs it with check mode off,
        because the nodes' checks read the nonce in check mode too.
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Write the shared directories' nonce files
  preflight_nonce:
    nonce: 4cZt8yQ2mW0pLr7sVb1nK9dE
    shared_dirs: "{{ results_dir | preflight_shared_dirs(job_id, job_attempt, image_cache_dir) }}"
    results_dir: /shared/results
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
nonce_files:
  description: The nonce files written (in check mode, those that would be).
  returned: always
  type: list
  elements: str
  sample: ["/shared/results/4242/attempt-0/preflight.nonce"]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight import (
    NONCE_ARGUMENT_SPEC,
    write_shared_nonces,
)


def run_module(module: AnsibleModule) -> None:
    params = module.params
    if module.check_mode:
        module.exit_json(changed=True, nonce_files=[entry["nonce_file"] for entry in params["shared_dirs"]])
    try:
        written = write_shared_nonces(params["nonce"], params["shared_dirs"], params["results_dir"])
    except (OSError, JobLayoutError) as exc:
        module.fail_json(msg=f"cannot write the preflight nonce: {exc}")
    module.exit_json(changed=True, nonce_files=written)


def main() -> None:
    module = AnsibleModule(
        argument_spec=NONCE_ARGUMENT_SPEC,
        supports_check_mode=True,
    )
    run_reporting_unexpected_errors(module, run_module, "preflight_nonce")


if __name__ == "__main__":
    main()
