#!/usr/bin/python
"""Ansible module: leave the attempt's ABORT marker, which stops every other node (logic in module_utils)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: abort_marker
short_description: Leave the attempt's ABORT marker so that every other node of the run stops
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Writes C(<job_dir>/ABORT) (JSON C(rank), C(node), C(reason)); the first node's marker stands, so later
    failures - often consequences of the first - never replace the root cause. In pull mode, where no controller
    stops the other nodes, they watch this marker instead.
version_added: "0.2.0"
author:
  - slurm-multi maintainers
options:
  job_dir:
    description: The attempt's dir, C(<results_dir>/<job_id>/attempt-<N>), on storage every node sees.
    type: path
    required: true
  rank:
    description: This node's rank.
    type: int
    required: true
  node:
    description: This node's name.
    type: str
    required: true
  reason:
    description: Why this node stopped (what the others report).
    type: str
    required: true
attributes:
  check_mode:
    support: full
    details:
      - Says whether a marker is already there; writes nothing.
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Tell the other nodes to stop
  abort_marker:
    job_dir: /shared/results/4242/attempt-0
    rank: 2
    node: node3
    reason: "the Docker daemon on node3 does not answer"
"""

RETURN = r"""
written:
  description: Whether this call wrote the marker (false - another node's was there first, and it stands).
  returned: always
  type: bool
marker:
  description: The marker that stands now (this node's or the first node's).
  returned: always
  type: dict
  sample: {"rank": 2, "node": "node3", "reason": "the Docker daemon on node3 does not answer"}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors


def run_module(module: AnsibleModule) -> None:
    params = module.params
    written = False
    if not module.check_mode:
        try:
            written = write_abort_marker(params["job_dir"], params["rank"], params["node"], params["reason"])
        except OSError as error:
            module.fail_json(msg=f"cannot write the ABORT marker in {params['job_dir']}: {error.strerror}")
    module.exit_json(changed=written, written=written, marker=read_abort_marker(params["job_dir"]) or {})


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            job_dir=dict(type="path", required=True),
            rank=dict(type="int", required=True),
            node=dict(type="str", required=True),
            reason=dict(type="str", required=True),
        ),
        supports_check_mode=True,
    )
    run_reporting_unexpected_errors(module, run_module, "abort_marker")


if __name__ == "__main__":
    main()
