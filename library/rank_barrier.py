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
  - Runs on every node at once (forks >= node count, no serial or throttle), after the build stage. Rank 0 listens
    on O(master_addr); each worker connects and reports its rank, hostname and image ID. Once every rank
    1..nnodes-1 arrived with the image ID rank 0 announced (O(image_id) on rank 0), rank 0 sends GO to all.
  - Both sides prove they hold O(token) by an HMAC-SHA256 over the other side's fresh nonce, bound to the message,
    O(job_id), the worker's rank and the connection; the token never travels. A worker announces itself only to a
    listener that proved the token and is released only by an authenticated GO for its own image; a greeting, GO or
    ABORT that fails authentication is ignored, reported in RV(rejected), and the next candidate port is tried.
  - A worker with another image makes rank 0 send ABORT, naming that node, to every connected worker. At O(timeout)
    rank 0 sends ABORT and fails naming the missing ranks (and their O(hosts)); a worker fails at its own O(timeout).
  - When rank 0 cannot open the barrier at all (every candidate port taken, O(master_addr) not its own), it writes
    the job's ABORT marker in O(job_dir), and the workers fail at once with its reason.
  - The port is derived from O(master_port) and O(job_id) into O(port_range), O(port_candidates) candidates, the
    same on every node; rank 0 binds the first free one, workers try each in turn.
  - Rank 0 rejects, and logs with the peer address (RV(rejected), the node's syslog), connections with a READY
    that fails authentication, a rank out of range, a duplicate rank from another host, garbage, oversized or
    half-sent lines, or no complete line within O(idle_timeout); it keeps serving the others.
  - The line protocol is described in docs/contracts.md.
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
    description:
      - The SLURM job ID; the other input of the port derivation. Every message's MAC covers it, so a token
        reused across jobs never lets one job's messages count in another's barrier.
    type: str
    required: true
  token:
    description:
      - Per-run shared secret (C(MAD_BARRIER_TOKEN), or generated per run), 1-255 printable ASCII characters
        without spaces. It keys every message's HMAC-SHA256 and is never sent, logged or returned.
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
      - The job's results directory on the shared filesystem, holding the job's ABORT marker. Without it, workers
        learn that rank 0 could not open the barrier only at their O(timeout).
    type: path
  heartbeat_stale:
    description:
      - Seconds a node's heartbeat (O(heartbeat), in C(nodes/<host>/) of O(job_dir)) may stand still before the node
        is taken for dead (ABORT naming it), so a dead node costs this, not O(timeout); needs O(job_dir) and
        O(hosts); 0 watches none. A worker gives rank 0 up so (RV(aborted_by_rank) 0). In pull mode rank 0 watches
        the workers, and its own playbook - dead, it writes the ABORT marker rather than release the workers.
    type: float
    default: 0
  heartbeat:
    description:
      - Which heartbeat shows a node alive - C(playbook), the C(playbook.alive) the preparation stage rewrites every
        2 s while a node's ansible-playbook lives (pull mode); C(module), the C(module.alive) rank 0's barrier module
        rewrites while it runs (push mode).
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
    # rank 0: the image it built or reused; workers: the image their load step left on the node
    image_id: "{{ node_image_id }}"
    timeout: 600
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
    - On rank 0, the connections rejected; on a worker, the listeners whose greeting, GO or ABORT it refused
      (another job's barrier, another service, an impostor). Each with the peer address and why; at most 256.
  returned: always
  type: list
  elements: dict
  sample: [{"peer": "10.0.0.99:40112",
            "reason": "rank 1: READY failed authentication (wrong token, or a line replayed from another connection)"}]
aborted_by_rank:
  description:
    - On a worker stopped by the job's ABORT marker (or rank 0's ABORT with the marker written), the rank it names;
      0 when the worker found rank 0 lost (O(heartbeat_stale)).
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
