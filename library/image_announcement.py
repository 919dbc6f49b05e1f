#!/usr/bin/python
"""Ansible module: rank 0 announces its image to the workers, or a worker waits for it (module_utils/image/)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: image_announcement
short_description: Announce rank 0's image to the workers through the attempt's dir, or wait for it (pull mode)
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Pull mode's image handoff - rank 0 writes C(<job_dir>/image.json) once every node can get its image
    (O(state=announced)), a worker waits for it (O(state=received)) and stops at once on the attempt's C(ABORT).
    The barrier then checks, authenticated, that every node holds the announced ID.
version_added: "0.2.0"
author:
  - slurm-multi maintainers
options:
  state:
    description: C(announced) on rank 0 (writes the file), C(received) on a worker (waits for it).
    type: str
    required: true
    choices: [announced, received]
  job_dir:
    description: The attempt's dir, C(<results_dir>/<job_id>/attempt-<N>), on storage every node sees.
    type: path
    required: true
  reference:
    description: With C(announced), what every node runs (the local image name, or the digest reference).
    type: str
  image_id:
    description: With C(announced), rank 0's image ID (C(sha256:<64 hex>), from C(docker image inspect)).
    type: str
  timeout:
    description: With C(received), seconds to wait; 0 waits as long as the job runs (rank 0 may build for long).
    type: float
    default: 0
  rank0_node:
    description:
      - With C(received), rank 0's node; the wait also ends once its playbook heartbeat stood still for
        O(heartbeat_stale).
    type: str
  heartbeat_stale:
    description: With O(rank0_node), how long rank 0's heartbeat may stand still before the wait gives up.
    type: float
    default: 30
attributes:
  check_mode:
    support: partial
    details:
      - Validates the options; writes nothing and does not wait (a worker returns what is there, else nulls).
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Announce rank 0's image to the workers
  image_announcement:
    state: announced
    job_dir: /shared/results/4242/attempt-0
    reference: ci-dummy_dummy
    image_id: sha256:0f3a7c1e4b2d9f8a6c5e3b1d7f9a2c4e6b8d0f1a3c5e7b9d2f4a6c8e0b1d3f5a
  when: node_rank == 0

- name: Wait for rank 0's image
  image_announcement:
    state: received
    job_dir: /shared/results/4242/attempt-0
  register: announced_image
  when: node_rank > 0
"""

RETURN = r"""
reference:
  description: The image reference every node runs.
  returned: success
  type: str
  sample: ci-dummy_dummy
image_id:
  description: Rank 0's image ID.
  returned: success
  type: str
  sample: sha256:0f3a7c1e4b2d9f8a6c5e3b1d7f9a2c4e6b8d0f1a3c5e7b9d2f4a6c8e0b1d3f5a
waited_seconds:
  description: With C(received), how long the worker waited for rank 0.
  returned: when state is received
  type: float
  sample: 2.4
aborted_by_rank:
  description: When the wait failed, the rank whose ABORT marker gave the run up (null when none did).
  returned: failure
  type: int
  sample: 0
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    AnnouncementError,
    wait_for_announcement,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import (
    HEARTBEAT_STALE_SECONDS,
    PLAYBOOK_HEARTBEAT_FILE,
    Heartbeat,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors


def run_module(module: AnsibleModule) -> None:
    params = module.params
    if module.check_mode:
        announced = params["state"] == "announced"
        module.exit_json(
            changed=announced,
            msg="check mode: nothing was written or waited for",
            reference=params["reference"] if announced else None,
            image_id=params["image_id"] if announced else None,
        )
    try:
        if params["state"] == "announced":
            announcement = write_announcement(params["job_dir"], params["reference"], params["image_id"])
            module.exit_json(changed=True, **announcement)
        heartbeat = None
        if params["rank0_node"]:
            node_dir = os.path.join(params["job_dir"], "nodes", params["rank0_node"])
            heartbeat = Heartbeat(os.path.join(node_dir, PLAYBOOK_HEARTBEAT_FILE), params["heartbeat_stale"])
        announcement = wait_for_announcement(
            params["job_dir"], params["timeout"], rank0_heartbeat=heartbeat, rank0=f"rank 0 ({params['rank0_node']})"
        )
    except AnnouncementError as error:
        # A node stopped by another rank's ABORT marker says so: the record then blames that rank, not this node.
        module.fail_json(msg=str(error), changed=False, aborted_by_rank=error.aborted_by_rank)
    except OSError as error:
        module.fail_json(msg=str(error), changed=False)
    module.exit_json(changed=False, **announcement)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", required=True, choices=["announced", "received"]),
            job_dir=dict(type="path", required=True),
            reference=dict(type="str"),
            image_id=dict(type="str"),
            timeout=dict(type="float", default=0.0),
            rank0_node=dict(type="str"),
            heartbeat_stale=dict(type="float", default=HEARTBEAT_STALE_SECONDS),
        ),
        required_if=[("state", "announced", ("reference", "image_id"))],
        supports_check_mode=True,
    )
    run_reporting_unexpected_errors(module, run_module, "image_announcement")


if __name__ == "__main__":
    main()
