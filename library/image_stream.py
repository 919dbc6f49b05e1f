#!/usr/bin/python
"""Ansible module: stream rank 0's image to every node's docker load (image_transport stream).

The logic is in module_utils/image/stream.py.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: image_stream
short_description: Stream rank 0's image into every node's docker load over TCP, writing the cache entry on the way
extends_documentation_fragment:
  - module_attributes
  - docker_cli
description:
  - Runs on every node of the allocation at once (one task). Rank 0 runs C(docker save) once and tees the bytes
    into the shared tar cache entry (the file and marker the C(image_cache) module's publish writes, so a later
    job still finds the tar) and to its children; every worker pipes what it receives into C(docker load) as it
    arrives and forwards it to its own children (O(fanout) per node; 1 makes a chain). When the cache already
    holds the entry, rank 0 streams that file instead of saving.
  - Each hop is TCP from a child to its parent's address on a port derived from the job, authenticated with the
    run's barrier token (an HMAC over the other side's fresh nonce; the token never travels).
  - The stream ends with its size and sha256. Every receiver holds the last bytes back from C(docker load) until
    both match, so a broken stream (a sender or a hop died, a byte changed) aborts every load downstream before
    the daemon registers anything; those nodes then load the shared tar cache (waiting up to O(fallback_wait)
    seconds for rank 0 to commit it). The image ID is checked after the load.
  - A node that already holds the image only forwards; rank 0 skips the transfer when no node needs it.
version_added: "0.3.0"
author:
  - slurm-multi maintainers
options:
  rank:
    description: This node's rank; 0 sends.
    type: int
    required: true
  hosts:
    description: The allocation's node names in rank order (C(allocation_nodes)).
    type: list
    elements: str
    required: true
  addresses:
    description:
      - The nodes' IPv4 addresses in rank order. Default - each name resolved, a non-loopback address preferred
        (a name resolving only to the Debian C(127.0.1.1) trap is refused).
    type: list
    elements: str
  master_port:
    description: The job's C(MASTER_PORT), from which (with O(job_id)) the listeners' ports are derived.
    type: int
    required: true
  job_id:
    description: The SLURM job ID.
    type: str
    required: true
  token:
    description: The run's barrier token; never logged, never sent.
    type: str
    required: true
  image:
    description:
      - On rank 0, the image to stream (tag or ID on its daemon); required there.
      - On a worker, the tag that must point at the image afterwards.
    type: str
  image_id:
    description:
      - On a worker, rank 0's image ID when known in advance (pull mode's announcement) - the stream must carry
        it, and the cache fallback needs it when the parent cannot be reached. Default - the parent's greeting.
    type: str
  announce_dir:
    description:
      - On rank 0 in pull mode, the attempt's dir - rank 0's announcement (C(image.json)) is written there once
        its listener is up, so that the workers start their side.
    type: path
  job_dir:
    description:
      - The attempt's dir. This node's figures go to C(image_stream.rank<rank>.json) there - bytes and rate,
        rewritten every few seconds for images over 1 GB (C(slurm-multi submit --wait) shows them), then the
        outcome.
    type: path
  cache_dir:
    description: The shared tar cache directory (C(MAD_DOCKER_BUILDS) overrides it).
    type: path
    required: true
  fanout:
    description: Children per node (1 - a chain, 2 - a binary tree).
    type: int
    default: 1
  port_range:
    description: The range the ports are derived into, C(LOW-HIGH).
    type: str
    default: 20000-29999
  port_candidates:
    description: How many derived ports a listener tries (and a child connects to, in order).
    type: int
    default: 3
  setup_timeout:
    description: Seconds a node waits for its parent to answer and its children to join.
    type: float
    default: 120.0
  io_timeout:
    description: Seconds a hop may stall (no byte received or sent) before the stream counts as broken.
    type: float
    default: 120.0
  fallback_wait:
    description:
      - Seconds a worker whose stream broke waits for the shared cache entry's commit marker.
      - It gives up sooner when rank 0's heartbeat file beside the entry stands still for O(heartbeat_stale)
        seconds (rank 0 died) or goes without a marker (rank 0's task failed).
    type: float
    default: 300.0
  heartbeat_stale:
    description:
      - Seconds rank 0's heartbeat beside the cache entry may stand still before a worker's O(fallback_wait)
        gives up (rank 0 rewrites it every 2 s; allow for the time the shared filesystem takes to show a change).
    type: float
    default: 30.0
attributes:
  check_mode:
    support: partial
    details:
      - Streams, saves and loads nothing; returns at once.
  diff_mode:
    support: none
"""

EXAMPLES = r"""
- name: Hand rank 0's image to every node by streaming it
  image_stream:
    rank: "{{ node_rank }}"
    hosts: "{{ allocation_nodes }}"
    master_port: "{{ master_port }}"
    job_id: "{{ job_id }}"
    token: "{{ barrier_token }}"
    image: ci-dummy_dummy.ubuntu.amd
    cache_dir: "{{ image_cache_dir }}"
  register: streamed_image
"""

RETURN = r"""
action_taken:
  description:
    - Rank 0 - C(streamed) (saved once into the cache entry and the stream), C(streamed-from-cache) (the entry
      was there), C(saved) (the stream was given up or nobody joined it; the entry was written the plain way),
      C(skipped) (every node holds the image).
    - A worker - C(streamed), C(loaded-from-cache) (the stream broke; see C(stream_error)), C(already-present)
      (it only forwarded), C(skipped).
  returned: success
  type: str
  sample: streamed
image_id:
  description: The image ID this node holds (docker image inspect's).
  returned: success
  type: str
  sample: sha256:8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0
bytes:
  description: Bytes this node streamed (sent on rank 0, received on a worker), or loaded from the cache.
  returned: success
  type: int
  sample: 209715200
rate_mb_s:
  description: The stream's rate on this node, MB/s.
  returned: when bytes were streamed
  type: float
  sample: 180.4
seconds:
  description: Time this node's part took.
  returned: success
  type: float
  sample: 3.2
stream_error:
  description: Why this node's stream broke (it then loaded the cache), naming the node; null when it did not.
  returned: success
  type: str
  sample: "rank 2 (node3): node2:20431 closed the connection mid-stream"
children_lost:
  description: The children this node could not serve (they loaded the cache), and why.
  returned: success
  type: dict
  sample: {"rank 2 (node3)": "never joined"}
progress:
  description: For images over 1 GB, this node's bytes and rate, every few seconds.
  returned: when the image is over 1 GB
  type: list
  elements: dict
step:
  description:
    - When this node's C(publish) (rank 0) or C(load) (a worker) step started and ended (seconds since the epoch),
      for the job's timeline; the run module writes it into the node's C(status.json) (C(steps), docs/contracts.md).
  returned: always, but in check mode
  type: dict
  sample: {"name": "load", "start": 1764523800.12, "end": 1764523841.5}
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    HEARTBEAT_STALE_SECONDS,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    DEFAULT_DOCKER_TIMEOUT,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.tar_cache import ImageCache
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream import (
    DEFAULT_FALLBACK_WAIT,
    receive_image,
    send_image,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream_protocol import (
    DEFAULT_IO_TIMEOUT,
    DEFAULT_SETUP_TIMEOUT,
    StreamError,
    StreamJob,
    derive_stream_ports,
    node_address,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.wire import DEFAULT_PORT_RANGE, parse_port_range

ARGUMENT_SPEC = dict(
    rank=dict(type="int", required=True),
    hosts=dict(type="list", elements="str", required=True),
    addresses=dict(type="list", elements="str"),
    master_port=dict(type="int", required=True),
    job_id=dict(type="str", required=True),
    token=dict(type="str", required=True, no_log=True),
    image=dict(type="str"),
    image_id=dict(type="str"),
    announce_dir=dict(type="path"),
    job_dir=dict(type="path"),
    cache_dir=dict(type="path", required=True),
    fanout=dict(type="int", default=SETTING_DEFAULTS["image_stream_fanout"]),
    port_range=dict(type="str", default="{}-{}".format(*DEFAULT_PORT_RANGE)),
    port_candidates=dict(type="int", default=3),
    setup_timeout=dict(type="float", default=DEFAULT_SETUP_TIMEOUT),
    io_timeout=dict(type="float", default=DEFAULT_IO_TIMEOUT),
    fallback_wait=dict(type="float", default=DEFAULT_FALLBACK_WAIT),
    heartbeat_stale=dict(type="float", default=HEARTBEAT_STALE_SECONDS),
    docker_host=dict(type="str"),
    docker_timeout=dict(type="float", default=DEFAULT_DOCKER_TIMEOUT),
)


def _job(params: dict) -> StreamJob:
    hosts = params["hosts"]
    if not 0 <= params["rank"] < len(hosts):
        raise StreamError(f"rank {params['rank']} is not one of the {len(hosts)} hosts' ranks")
    if params["fanout"] < 1:
        raise StreamError(f"fanout must be 1 or more, got {params['fanout']}")
    addresses = params["addresses"] or [node_address(host) for host in hosts]
    if len(addresses) != len(hosts):
        raise StreamError(f"addresses names {len(addresses)} nodes, hosts {len(hosts)}: give one address per node")
    ports = derive_stream_ports(
        params["master_port"], params["job_id"], parse_port_range(params["port_range"]), params["port_candidates"]
    )
    return StreamJob(
        params["token"],
        params["job_id"],
        params["rank"],
        hosts,
        addresses,
        ports,
        params["fanout"],
        params["setup_timeout"],
        params["io_timeout"],
    )


def _node(params: dict) -> str:
    rank, hosts = params["rank"], params["hosts"]
    return f"rank {rank} ({hosts[rank] if 0 <= rank < len(hosts) else '?'})"


def _figures_writer(params: dict, progress: list):
    """Keep `progress` and, given a job_dir, this node's figures file up to date with each report."""
    path = os.path.join(params["job_dir"], f"image_stream.rank{params['rank']}.json") if params["job_dir"] else None

    def report(figures: dict) -> None:
        progress.append(figures)
        if path:
            node = {"rank": params["rank"], "node": params["hosts"][params["rank"]]}
            try:
                write_file_atomically(path, json.dumps(dict(node, **figures)).encode("utf-8"))
            except OSError:
                pass  # figures only: the stream goes on without them

    return report


def run_module(module: AnsibleModule) -> None:
    params = module.params
    if module.check_mode:
        module.exit_json(changed=False, msg="check mode: nothing was streamed")
    progress = []
    report = _figures_writer(params, progress)
    try:
        job = _job(params)
        cache = ImageCache(
            resolve_cache_dir(params["cache_dir"]),
            docker_host=params["docker_host"],
            docker_timeout=params["docker_timeout"],
        )
        if job.rank == 0:
            if not params["image"]:
                raise StreamError("rank 0 streams `image`: give the image to stream")
            announce = None
            if params["announce_dir"]:

                def announce(image_id: str) -> None:
                    write_announcement(params["announce_dir"], params["image"], image_id)

            result = send_image(cache, params["image"], job, announce=announce, report=report)
        else:
            result = receive_image(
                cache,
                job,
                image=params["image"],
                image_id=params["image_id"],
                fallback_wait=params["fallback_wait"],
                report=report,
                heartbeat_stale=params["heartbeat_stale"],
            )
    except (UserError, OSError) as error:
        message = f"image stream on {_node(params)}: {error}"
        report({"done": True, "failed": message})
        module.fail_json(msg=message, changed=False)
    result["progress"] = list(progress)
    report(dict(result, done=True, size_estimate=progress[-1]["size_estimate"] if progress else 0))
    module.exit_json(**result)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("rank", 0, ("image",))],
        supports_check_mode=True,
    )
    run_reporting_unexpected_errors(
        module, run_module, "image_stream", step=lambda module: "publish" if module.params["rank"] == 0 else "load"
    )


if __name__ == "__main__":
    main()
