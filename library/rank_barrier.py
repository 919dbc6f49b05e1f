#!/usr/bin/python
"""Ansible module: the rank-0 image-ready barrier (the logic is in module_utils/barrier/)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rank_barrier
short_description: Hold every node of a multi-node run until all of them hold the image rank 0 announced
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Runs on every node at once, after the build stage. Rank 0 listens on O(master_addr); once every worker reported
    the image ID rank 0 announced, rank 0 sends GO to all; a worker with another image, or O(timeout), makes it
    send ABORT.
  - Every message is authenticated by an HMAC-SHA256 keyed with O(token), which never travels; bad connections are
    rejected and reported in RV(rejected). The port is derived from O(master_port) and O(job_id) into O(port_range).
    docs/contracts.md describes the protocol.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  rank:
    description: This node's rank; 0 serves the barrier, 1..nnodes-1 join it.
    type: int
    required: true
  nnodes:
    description: Number of nodes in the run, rank 0 included.
    type: int
    required: true
  hosts:
    description: The allocation's node names in rank order (O(nnodes) of them); rank 0 names missing ranks by them.
    type: list
    elements: str
  master_addr:
    description: Rank 0's IP address on the nodes' network; rank 0 binds exactly it, workers connect to it.
    type: str
    required: true
  master_port:
    description: The job's MASTER_PORT; one of the two inputs of the port derivation.
    type: int
    required: true
  job_id:
    description: The SLURM job ID; an input of the port derivation, covered by every message's MAC.
    type: str
    required: true
  token:
    description: Per-run shared secret, 1-255 printable ASCII characters without spaces; never sent, logged or returned.
    type: str
    required: true
  image_id:
    description: On rank 0, the image ID it announces; on a worker, the ID of the image this node holds.
    type: str
    required: true
  timeout:
    description: Seconds the barrier may take overall, on every rank; a lost node costs this much.
    type: float
    default: 600
  port_range:
    description: Range the barrier's port is derived into, as C(LOW-HIGH).
    type: str
    default: "20000-29999"
  port_candidates:
    description: How many ports of the range are tried, in the same order on every node.
    type: int
    default: 3
  connect_timeout:
    description: Seconds a worker's connect may take before it tries again (a dead node drops packets).
    type: float
    default: 2
  idle_timeout:
    description: Seconds rank 0 gives a connection to send its READY line before rejecting it.
    type: float
    default: 10
  job_dir:
    description:
      - The job's results dir holding its ABORT marker; without it, workers learn of rank 0's failure only at
        O(timeout).
    type: path
  heartbeat_stale:
    description:
      - Seconds a node's heartbeat may stand still before it is taken for dead (needs O(job_dir), O(hosts)); 0 watches
        none.
    type: float
    default: 0
  heartbeat:
    description:
      - Which heartbeat shows a node alive - its ansible-playbook's (C(playbook), pull mode) or rank 0's module's
        (C(module)).
    type: str
    choices: [playbook, module]
    default: playbook
attributes:
  check_mode:
    support: partial
    details:
      - Validates the options and returns the candidate ports without waiting at the barrier (RV(port) is null).
  diff_mode:
    support: N/A
    details:
      - Changes nothing on the node, so there is nothing to diff.
notes:
  - Changes nothing on the node, so RV(changed) is always false.
"""

EXAMPLES = r"""
- name: Wait until every node holds the image rank 0 announced
  rank_barrier:
    rank: "{{ node_rank }}"
    nnodes: "{{ nnodes }}"
    hosts: "{{ ansible_play_hosts_all }}"
    master_addr: "{{ master_addr }}"
    master_port: "{{ master_port }}"
    job_id: "{{ slurm_job_id }}"
    job_dir: "{{ results_dir }}/{{ slurm_job_id }}"
    token: "{{ barrier_token }}"
    image_id: "{{ node_image_id }}"
"""

RETURN = r"""
port:
  description: The port the barrier ran on; null for a one-node run or in check mode.
  returned: success
  type: int
  sample: 23638
ports:
  description: The candidate ports derived for this job, in the order they are tried.
  returned: always
  type: list
  elements: int
  sample: [20305, 23638, 26971]
waited_seconds:
  description: Seconds this node spent at the barrier.
  returned: success
  type: float
  sample: 12.4
workers:
  description:
    - On rank 0, the ranks released, each with its hostname, peer address and arrival (seconds after rank 0 opened).
  returned: success
  type: list
  elements: dict
  sample: [{"rank": 1, "hostname": "node2", "peer": "10.0.0.12:51234", "arrived_seconds": 3.2114}]
rejected:
  description:
    - The connections (rank 0) or listeners (a worker) refused, each with the peer address and why; at most 256.
  returned: always
  type: list
  elements: dict
  sample: [{"peer": "10.0.0.99:40112",
            "reason": "rank 1: READY failed authentication (wrong token, or a line replayed from another connection)"}]
aborted_by_rank:
  description: On a worker stopped by the job's ABORT (or finding rank 0 lost, 0), the rank it names.
  returned: failed
  type: int
  sample: 0
missing:
  description: On a rank-0 timeout, the ranks that never arrived and their hostnames (null without O(hosts)).
  returned: failed
  type: list
  elements: dict
  sample: [{"rank": 2, "host": "node3"}]
step:
  description: When this node's C(barrier) step started and ended (epoch seconds), for the timeline.
  returned: always, but in check mode
  type: dict
  sample: {"name": "barrier", "start": 1764523800.12, "end": 1764523841.5}
"""

import contextlib

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import BarrierFailed
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.node import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_PORT_CANDIDATES,
    NodeAtBarrier,
    barrier_logger,
    meet_every_node,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import DEFAULT_TIMEOUT
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import DEFAULT_PORT_RANGE
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import (
    HEARTBEATS,
    beating,
    node_liveness,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors

ARGUMENT_SPEC = dict(
    rank=dict(type="int", required=True),
    nnodes=dict(type="int", required=True),
    hosts=dict(type="list", elements="str"),
    master_addr=dict(type="str", required=True),
    master_port=dict(type="int", required=True),
    job_id=dict(type="str", required=True),
    token=dict(type="str", required=True, no_log=True),
    image_id=dict(type="str", required=True),
    timeout=dict(type="float", default=DEFAULT_TIMEOUT),
    port_range=dict(type="str", default="{}-{}".format(*DEFAULT_PORT_RANGE)),
    port_candidates=dict(type="int", default=DEFAULT_PORT_CANDIDATES),
    connect_timeout=dict(type="float", default=DEFAULT_CONNECT_TIMEOUT),
    idle_timeout=dict(type="float", default=DEFAULT_IDLE_TIMEOUT),
    job_dir=dict(type="path"),
    heartbeat_stale=dict(type="float", default=0),
    heartbeat=dict(type="str", default="playbook", choices=list(HEARTBEATS)),
)


def run_module(module: AnsibleModule) -> None:
    """Wait at the barrier as this node's rank and report, or fail with what to fix."""
    node = NodeAtBarrier(
        **{name: module.params[name] for name in ARGUMENT_SPEC if name != "hosts"}, hosts=module.params["hosts"] or []
    )
    result = dict(changed=False, ports=node.ports, rejected=[])
    if node.heartbeat_stale < 0:
        module.fail_json(
            msg=f"heartbeat_stale must be 0 (off) or a positive number of seconds, got {node.heartbeat_stale!r}"
        )
    if module.check_mode:
        module.exit_json(msg="check mode: the barrier was not awaited", port=None, waited_seconds=0.0, **result)
    liveness = node_liveness(node.job_dir, node.hosts, node.rank, node.heartbeat, node.heartbeat_stale)
    beat = contextlib.ExitStack()
    try:
        beat.enter_context(beating(liveness.beat))
    except OSError as error:  # the node's dir cannot take it: the workers would give rank 0 up for dead
        module.fail_json(msg=f"cannot write rank 0's heartbeat {liveness.beat}: {error.strerror or error}", **result)
    try:
        with beat:
            outcome = meet_every_node(node, barrier_logger(module), liveness.watch)
    except BarrierFailed as failure:
        for warning in failure.fields.pop("warnings", []):
            module.warn(warning)
        module.fail_json(msg=str(failure), **dict(result, **failure.fields))
    for warning in outcome.pop("warnings"):
        module.warn(warning)
    module.exit_json(**dict(result, **outcome))


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "rank_barrier", step="barrier", changed=False)


if __name__ == "__main__":
    main()
