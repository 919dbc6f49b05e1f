#!/usr/bin/python
"""Ansible module: hand rank 0's Charliecloud image (one squashfs in the shared cache) to every node, made ready."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: charliecloud_image
short_description: Announce rank 0's squashfs image and make every node ready to run it (in place, or unpacked once)
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - With O(state=published) (rank 0), checks the committed squashfs entry O(image_id) in the shared cache, announces
    it in O(announce_dir) and makes this node ready; with O(state=ready) (a worker), waits for that announcement and
    makes this node ready to run the entry it names (docs/no-docker.md).
  - Ready means in place when this user can mount squashfs on this node (ch-run's SquashFUSE, /dev/fuse), else the
    file unpacked once into O(unpack_dir) as a directory named by its digest, made under a temp name and renamed
    into place whole; a torn unpack is never run, and a whole one is reused by later jobs.
  - The cache dir is checked as the tar cache's is (yours or root's, not writable by others).
options:
  state:
    description: C(published) on rank 0, C(ready) on a worker.
    type: str
    required: true
    choices: [published, ready]
  image_id:
    description: With C(published), the image's identity C(sha256:<hex>) (the build manifest's C(image_id)).
    type: str
  cache_dir:
    description: The shared image cache (the node's C(MAD_DOCKER_BUILDS) overrides it).
    type: path
    required: true
  unpack_dir:
    description: The node-local dir a node without FUSE unpacks into; C(%u) is the user's name.
    type: str
    default: /var/tmp/slurm-multi-%u/images
  mountable:
    description: Whether this node runs the squashfs in place; unset, this node finds out (/dev/fuse for this user).
    type: bool
  announce_dir:
    description: The run's attempt dir, where rank 0 announces; none for a one-node run.
    type: path
  rank0_node:
    description: Rank 0's node (its heartbeat is in its node dir under O(announce_dir)); required with O(announce_dir).
    type: str
  heartbeat:
    description: What shows rank 0 alive while workers wait - its ansible-playbook's (C(playbook)) or this module's.
    type: str
    choices: [playbook, module]
    default: playbook
  heartbeat_stale:
    description: Seconds rank 0's heartbeat may stand still before a waiting worker gives it up; 0 watches none.
    type: float
    default: 0
  marker_wait:
    description: With C(ready), how long to wait for the entry's commit marker (network filesystems show files late).
    type: float
    default: 10.0
attributes:
  check_mode:
    support: none
  diff_mode:
    support: none
version_added: "0.4.0"
author:
  - slurm-multi maintainers
"""

EXAMPLES = r"""
- name: Hand rank 0's squashfs image to every node, each made ready
  charliecloud_image:
    state: "{{ 'published' if node_rank == 0 else 'ready' }}"
    image_id: "{{ node_image.image_id }}"
    cache_dir: "{{ image_cache_dir }}"
    unpack_dir: "{{ charliecloud_unpack_dir }}"
    announce_dir: "{{ attempt_dir }}"
    rank0_node: "{{ groups['primary'][0] }}"
"""

RETURN = r"""
reference:
  description: The path this node runs with ch-run - the shared squashfs (in place) or the unpacked directory.
  returned: always
  type: str
  sample: /var/tmp/slurm-multi-alice/images/8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0
image_id:
  description: The image's identity, C(sha256:<hex>) of the squashfs file.
  returned: always
  type: str
  sample: sha256:8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0
how:
  description: C(in-place), C(unpacked) or C(already-unpacked).
  returned: always
  type: str
  sample: in-place
why:
  description: Why this node runs in place or unpacks (what it found of /dev/fuse).
  returned: always
  type: str
squashfs:
  description: The shared squashfs entry.
  returned: always
  type: str
bytes:
  description: Bytes this node read from the cache to be ready (0 in place).
  returned: always
  type: int
removed:
  description: Torn unpacks and leftover temps this node removed.
  returned: when this node unpacked
  type: list
  elements: str
seconds:
  description: Time this node took to be ready.
  returned: always
  type: float
step:
  description: When this node's C(publish) or C(load) step started and ended (epoch seconds), for the timeline.
  returned: always, but in check mode
  type: dict
  sample: {"name": "load", "start": 1764523800.12, "end": 1764523804.5}
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import AnnouncementError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    DEFAULT_MARKER_WAIT,
    CacheDirectory,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.handoff import Rank0
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import HEARTBEATS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import step_record
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.handoff import (
    publish_and_ready,
    receive_and_ready,
)

ARGUMENT_SPEC = dict(
    state=dict(type="str", required=True, choices=["published", "ready"]),
    image_id=dict(type="str"),
    cache_dir=dict(type="path", required=True),
    unpack_dir=dict(type="str", default=SETTING_DEFAULTS["charliecloud_unpack_dir"]),
    mountable=dict(type="bool"),
    announce_dir=dict(type="path"),
    rank0_node=dict(type="str"),
    heartbeat=dict(type="str", default="playbook", choices=list(HEARTBEATS)),
    heartbeat_stale=dict(type="float", default=0),
    marker_wait=dict(type="float", default=DEFAULT_MARKER_WAIT),
)
REQUIRED_IF = [("state", "published", ["image_id"]), ("state", "ready", ["announce_dir"])]
REQUIRED_BY = {"announce_dir": ("rank0_node",)}


def run_module(module: AnsibleModule) -> None:
    params = module.params
    cache = CacheDirectory(resolve_cache_dir(params["cache_dir"]))
    rank0 = None
    if params["announce_dir"]:
        rank0 = Rank0(params["announce_dir"], params["rank0_node"], params["heartbeat"], params["heartbeat_stale"])
    if params["state"] == "published":
        started = time.time()
        result = publish_and_ready(cache, params["image_id"], params["unpack_dir"], rank0, params["mountable"])
        step = dict(step_record(started, result.pop("announced")), name="publish")
    else:
        try:
            result = receive_and_ready(cache, rank0, params["unpack_dir"], params["marker_wait"], params["mountable"])
        except AnnouncementError as error:
            module.fail_json(msg=str(error), aborted_by_rank=error.aborted_by_rank)
        step = dict(step_record(result.pop("started")), name="load")
    changed = result["how"] == "unpacked"
    module.exit_json(changed=changed, step=step, **result)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC, required_if=REQUIRED_IF, required_by=REQUIRED_BY, supports_check_mode=False
    )
    run_reporting_unexpected_errors(
        module, run_module, "charliecloud_image", step=lambda m: {"published": "publish"}.get(m.params["state"], "load")
    )


if __name__ == "__main__":
    main()
