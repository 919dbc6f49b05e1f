#!/usr/bin/python
"""Ansible module: the preflight checks of one node (module_utils/node/preflight.py), before anything expensive."""

DOCUMENTATION = r"""
module: node_preflight
short_description: Check that a node is fit for the run, reporting every problem at once
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Runs every enabled check on the node (docs/nodes.md) and fails listing every problem found, each with a fix;
    writes the result to C(<attempt_dir>/preflight/<node>.json). With O(exchange_wait) (pull mode) it then waits for
    every node's result.
options:
  node:
    description: The node's name in the allocation (the inventory host name).
    type: str
    required: true
  checks:
    description: The checks to run, among docker, disk, shared_dir, scratch, gpus, stale_gpu_containers, clock.
    type: list
    elements: str
    default: [docker, disk, shared_dir, scratch, gpus, stale_gpu_containers, clock]
  results_dir:
    description: The results directory (shared by every node and the controller).
    type: path
    required: true
  attempt_dir:
    description: The attempt's directory under O(results_dir), where the node's result goes.
    type: path
    required: true
  shared_dirs:
    description: The directories that must be shared, each C({name, path, nonce_file}) holding O(nonce).
    type: list
    elements: dict
    default: []
  nonce:
    description: The content of the nonce files.
    type: str
    default: ""
  write_nonce:
    description: This node writes the nonce files first (pull mode's rank 0; in push mode the controller does).
    type: bool
    default: false
  nonce_wait:
    description: Seconds to wait for a nonce file to appear (pull mode's other ranks, while rank 0 writes it).
    type: float
    default: 0
  nodes:
    description: Every node of the job, whose results O(exchange_wait) waits for.
    type: list
    elements: str
    default: []
  node_ranks:
    description: Every node's rank, C({node - rank}); a node stopped by another's problems names that rank.
    type: dict
    default: {}
  exchange_wait:
    description: Pull mode - seconds to wait for every node's result (0 - no exchange).
    type: float
    default: 0
  image_bytes:
    description: The image's size in bytes when known (the disk check then asks room for it).
    type: int
  image_ids:
    description:
      - The job's image IDs when known before the build; without O(image_bytes) the disk check asks room for them.
    type: list
    elements: str
    default: []
  image_cache_dir:
    description: The shared image cache, where O(image_ids)' tars may be.
    type: path
  disk_headroom_gb:
    description: Free space (GB) Docker's data root must keep on top of the image.
    type: float
    default: 5
  card_n_gpus:
    description: The model card's n_gpus when known (-1 all, 0 none).
    type: int
  gpu_vendor:
    description: The GPU vendor the run asks for (the context's gpu_vendor), empty for any.
    type: str
    default: ""
  reference_time:
    description: The controller's time (epoch seconds) when it sent the check; the clock check's reference.
    type: float
  clock_dir:
    description: Without O(reference_time), a shared directory whose new file's mtime is the reference.
    type: path
  max_clock_skew:
    description: Seconds this node's clock may differ from the reference.
    type: float
    default: 10
  container_runtime:
    description:
      - The job's runtime. With C(charliecloud) the C(docker) check is the runtime's (ch-run and its version, user
        namespaces, squashfs in place or unpacked, the shared cache) and C(disk) is on O(charliecloud_unpack_dir)
        when this node unpacks; C(stale_gpu_containers) and the node facts' removal of stale containers (Docker's)
        are skipped.
    type: str
    choices: [docker, charliecloud]
    default: docker
  charliecloud_unpack_dir:
    description: With C(charliecloud), where this node would unpack the image (node-local, C(%u) the user).
    type: str
    default: /var/tmp/slurm-multi-%u/images
  builds:
    description: This node builds the image (rank 0); with C(charliecloud), ch-image and mksquashfs must be there.
    type: bool
    default: false
  node_facts:
    description: Also read the node's facts (as M(node_facts) does with these options) once every check passed.
    type: dict
    suboptions:
      node:
        description: The node's name in the allocation (the inventory host name).
        type: str
        required: true
      results_dir:
        description: The results directory.
        type: path
        required: true
      job_id:
        description: The SLURM job ID (the job's directory name).
        type: str
        required: true
      attempt:
        description: The job's attempt.
        type: int
        default: 0
      resolve_master:
        description: Resolve rank 0's routable addresses (the C(node_facts) module's option).
        type: bool
        default: false
      master_host:
        description: Rank 0's host name, resolved with O(node_facts.resolve_master) on a node other than rank 0.
        type: str
        default: ""
      remove_stale_containers:
        description: Remove this user's containers whose run has ended (the C(stale_containers) module's rules).
        type: bool
        default: false
      container_runtime:
        description: What runs the containers (the C(node_facts) module's option); only C(docker) has a daemon.
        type: str
        default: docker
version_added: "0.3.0"
author:
  - slurm-multi maintainers
attributes:
  check_mode:
    support: partial
    details:
      - Runs the checks and writes the result and nonce files in check mode too, as later stages read them; waits
        for no other node (a worker then leaves out the shared-directory check, which needs rank 0's nonce).
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Check the node
  node_preflight:
    node: "{{ inventory_hostname }}"
    results_dir: /shared/results
    attempt_dir: /shared/results/4242/attempt-0
    shared_dirs:
      - {name: results_dir, path: /shared/results, nonce_file: /shared/results/4242/attempt-0/preflight.nonce}
    nonce: 3f2a...
    reference_time: "{{ now(fmt='%s.%f') }}"
  register: preflight_result
"""

RETURN = r"""
problems:
  description: Every problem found on this node, each C({check, problem, fix}); empty when it is healthy.
  returned: always
  type: list
  elements: dict
  sample: [{"check": "docker", "problem": "Docker daemon not answering on node3", "fix": "start dockerd on node3"}]
notes:
  description: What was not checked and why (the image's size unknown, no reference time...).
  returned: always
  type: list
  elements: str
time:
  description: This node's clock when it ran the checks (epoch seconds).
  returned: always
  type: float
aborted_by_rank:
  description: When this node failed only because another node has problems (pull mode), that node's rank.
  returned: on such a failure
  type: int
image_access:
  description: With O(container_runtime=charliecloud), how this node gets the image - C(in-place) or C(unpack).
  returned: when O(container_runtime=charliecloud) and the C(docker) check ran
  type: str
  sample: in-place
other_nodes:
  description: With O(exchange_wait), the other nodes' problems, C({node - [problems]}), for the nodes with some.
  returned: always
  type: dict
node_facts:
  description:
    - With O(node_facts), the C(node_facts) module's result for this node (its RETURN, with C(changed) and
      C(warnings)), or C({failed, msg}) when the node cannot take part.
  returned: when O(node_facts) is given and every check passed
  type: dict
step:
  description:
    - When this node's C(preflight) step started and ended (epoch seconds), for the timeline (C(status.json)'s
      C(steps)).
  returned: always, but in check mode
  type: dict
  sample: {"name": "preflight", "start": 1764523800.12, "end": 1764523841.5}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.dir_trust import make_job_dirs
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.facts import NODE_FACTS_OPTIONS, read_node
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight import (
    CHECKS,
    summary,
    wait_for_results,
    write_result,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import DEFAULT_RUNTIME, RUNTIMES, by_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.preflight import runtime_preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


def run_module(module: AnsibleModule) -> None:
    """Run the checks, write the node's result, (pull mode) wait for the others'; fail naming every problem."""
    params = module.params
    node = params["node"]
    if module.check_mode and params["nonce_wait"] > 0:
        # As the barrier: a check-mode run waits for no other node (they may not run at all), so a pull-mode
        # worker does not wait for rank 0's nonce and leaves the shared directories unchecked.
        params = dict(params, nonce_wait=0, checks=[c for c in params["checks"] if c != "shared_dir"])
    if module.check_mode:
        params = dict(params, exchange_wait=0)
    try:
        make_job_dirs(params["attempt_dir"], params["results_dir"])
    except JobLayoutError as exc:
        module.fail_json(msg=f"{node}: preflight: {exc}", problems=[], notes=[], other_nodes={})
    try:
        result = runtime_preflight(params)
    except ValueError as exc:
        module.fail_json(msg=f"{node}: preflight: {exc}", problems=[], notes=[], other_nodes={})
    write_result(params["attempt_dir"], result)
    others = {}
    if params["exchange_wait"] > 0 and not result["problems"]:
        others = wait_for_results(
            params["attempt_dir"], [n for n in params["nodes"] if n != node], params["exchange_wait"]
        )
    fields = dict(problems=result["problems"], notes=result["notes"], time=result["time"], other_nodes=others)
    # What the runtime's own checks add (charliecloud: image_access).
    fields.update({key: value for key, value in result.items() if key not in ("node", "problems", "notes", "time")})
    if result["problems"]:
        module.fail_json(msg=summary(result["problems"]), **fields)
    if others:
        # Stopped by another node, not a root cause itself: the rescue records aborted_by_rank (the first bad rank).
        ranks = params["node_ranks"]
        bad = sorted(others, key=lambda other: (ranks.get(other, len(ranks)), other))
        texts = "; ".join(f"{other}: {summary(others[other])}" for other in bad)
        module.fail_json(
            msg=f"preflight found problems on other nodes: {texts}", aborted_by_rank=ranks.get(bad[0]), **fields
        )
    if params["node_facts"] is not None:
        options = params["node_facts"]
        if "stale_gpu_containers" in by_name(params["container_runtime"]).replaces_checks:
            options = dict(options, remove_stale_containers=False)  # Docker's containers: none under this runtime
        fields["node_facts"] = read_facts(options, module.check_mode)
    module.exit_json(changed=False, **fields)


def read_facts(options: dict, check_mode: bool) -> dict:
    """The node_facts module's result, or its failure for the preparation stage to fail with."""
    try:
        return read_node(options, check_mode=check_mode)
    except UserError as exc:
        return {"failed": True, "msg": str(exc)}


ARGUMENT_SPEC = dict(
    node=dict(type="str", required=True),
    checks=dict(type="list", elements="str", default=list(CHECKS)),
    results_dir=dict(type="path", required=True),
    attempt_dir=dict(type="path", required=True),
    shared_dirs=dict(type="list", elements="dict", default=[]),
    nonce=dict(type="str", default="", no_log=False),
    write_nonce=dict(type="bool", default=False),
    nonce_wait=dict(type="float", default=0),
    nodes=dict(type="list", elements="str", default=[]),
    node_ranks=dict(type="dict", default={}),
    exchange_wait=dict(type="float", default=0),
    image_bytes=dict(type="int"),
    image_ids=dict(type="list", elements="str", default=[]),
    image_cache_dir=dict(type="path"),
    disk_headroom_gb=dict(type="float", default=SETTING_DEFAULTS["preflight_disk_headroom_gb"]),
    card_n_gpus=dict(type="int"),
    gpu_vendor=dict(type="str", default=""),
    reference_time=dict(type="float"),
    clock_dir=dict(type="path"),
    max_clock_skew=dict(type="float", default=SETTING_DEFAULTS["preflight_max_clock_skew"]),
    node_facts=dict(type="dict", options=NODE_FACTS_OPTIONS),
    container_runtime=dict(type="str", default=DEFAULT_RUNTIME, choices=list(RUNTIMES)),
    charliecloud_unpack_dir=dict(type="str", default=SETTING_DEFAULTS["charliecloud_unpack_dir"]),
    builds=dict(type="bool", default=False),
)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "node_preflight", step="preflight")


if __name__ == "__main__":
    main()
