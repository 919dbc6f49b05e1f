#!/usr/bin/python
"""Ansible module: run this node's model container of a multi-node job (logic in module_utils/run/)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_model
short_description: Run one node's model container of a multi-node job, follow it to its end and record its verdict
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Starts this node's container C(slurm-multi-<job_id>-r<rank>) detached (never C(--rm)), follows its log into the
    node dir until it exits, times out, another rank fails, rank 0 is lost or the run hangs, then writes the node's
    C(status.json). Runs on every node at once, without C(async); docs/contracts.md gives the details.
  - A model failure is data (the task succeeds, C(status.json) says FAILURE); only infrastructure errors fail the
    task. Secrets reach the container through a short-lived 0600 env file and are masked in every output
    (docs/secrets.md).
  - On SIGTERM, SIGINT or SIGHUP it snapshots and stops the container, records C(cancelled=true) and fails the task,
    within SLURM's default KillWait of 30 s.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  job_id:
    description: The SLURM job ID; names the container and the job's results dir.
    type: str
    required: true
  rank:
    description: This node's rank (NODE_RANK), 0..nnodes-1.
    type: int
    required: true
  nnodes:
    description: Number of nodes in the run (NNODES).
    type: int
    required: true
  node:
    description: This node's name, as the inventory knows it (default - the short hostname); names its node dir.
    type: str
  model:
    description: The model's name (from its card); recorded in the status and the container's label.
    type: str
    required: true
  image:
    description:
      - The image to run, already on this node (the build stage's job) - under Docker its tag or ID, under
        Charliecloud the path of its squashfs file or unpacked directory.
    type: str
    required: true
  image_id:
    description:
      - The image's ID the build stage checked on every node (C(sha256:...)), when it has one; the runtime picks
        which of O(image) and this it runs (Docker the ID, never a tag another job could move meanwhile).
    type: str
    default: ""
  container_runtime:
    description:
      - The runtime that runs the rank (docs/runtimes.md) - C(docker) (a daemon on the node) or C(charliecloud)
        (C(ch-run) as this module's own child, no daemon).
    type: str
    default: docker
  model_dir:
    description: Host dir holding the model's scripts; mounted read-write at C(/myworkspace).
    type: path
    required: true
  script:
    description: The model's script, relative to O(model_dir); exactly one of O(script) and O(scripts) is given.
    type: str
  scripts:
    description:
      - The model card's C(scripts) (a dir run by its C(run.sh), or a file), copied into O(model_dir) before the run.
    type: path
  model_args:
    description: The card's args, as one string (split like a shell would, without running one) or as a list.
    type: raw
    default: ""
  results_dir:
    description: The results dir shared by the job's nodes (docs/contracts.md lays it out).
    type: path
    required: true
  attempt:
    description: The job's attempt - C(SLURM_RESTART_COUNT), 0 for its first run; each has its own dir.
    type: int
    default: 0
  master_addr:
    description: Rank 0's address (MASTER_ADDR).
    type: str
    required: true
  master_port:
    description: The job's MASTER_PORT.
    type: int
    required: true
  user:
    description: The user name in the C(slurm-multi.user) label (default - the current user).
    type: str
  docker_env_vars:
    description: The context's environment; a C(${MAD_SECRETS_NAME}) placeholder gets that secret from O(secrets_file).
    type: dict
    default: {}
  docker_mounts:
    description: The context's mounts, container path -> host path.
    type: dict
    default: {}
  data_mounts:
    description:
      - The model's data as C(host:container[:ro]) binds (the card's C(data), module_utils/run/model_data.py); each
        host path must exist on the node.
    type: list
    elements: str
    default: []
  additional_docker_run_options:
    description: Extra C(docker run) options, as one string or an argv list (C(--rm) is refused).
    type: raw
    default: ""
  gpu_vendor:
    description: C(AMD) or C(NVIDIA) gives the container the allocation's GPUs; unset or C(none) for no GPUs.
    type: str
  guest_os:
    description: The run context's C(guest_os), the container's C(MAD_GUEST_OS) unless O(docker_env_vars) sets it.
    type: str
    default: UBUNTU
  gpus:
    description: The node's GPUs as the preparation stage's GPU facts list them (C(index), C(render_node), ...).
    type: list
    elements: dict
    default: []
  secrets_file:
    description:
      - The job's secrets file, C(KEY=VALUE) lines with C(MAD_SECRETS_*) keys, private to the user (docs/secrets.md).
    type: path
  timeout:
    description: The model's timeout in seconds; unset, 0 or -1 (MAD's none) for none.
    type: float
  job_end_time:
    description: The job's end as a UNIX epoch (from SLURM's end time); the run stops O(end_margin) seconds before it.
    type: float
  end_margin:
    description: Seconds before O(job_end_time) at which the run is stopped, leaving time for postprocessing.
    type: float
    default: 240
  error_patterns:
    description: Literal substrings that mark a failed run when a log line holds one (default - perf_lines' own).
    type: list
    elements: str
  multiple_results:
    description: The card's multiple-results CSV, relative to O(model_dir), copied into the node dir once written.
    type: str
  n_gpus:
    description: The card's C(n_gpus), GPUs per node - C(-1) all the allocation gives this node, N the first N of them.
    type: int
    default: -1
  skip_gpu_arch:
    description: The card's C(skip_gpu_arch); a node whose GPUs match one records SKIPPED and stops the other ranks.
    type: list
    elements: str
    default: []
  stop_grace:
    description: Seconds C(docker stop) gives the model on an abort or timeout before killing it.
    type: int
    default: 10
  diagnostics_log_dirs:
    description: Dirs inside the container whose C(*.log) files' tails go into the diagnostics of a hung container.
    type: list
    elements: str
    default: [/run_logs]
  steps:
    description: This node's earlier steps' C(start) and C(end) by name (the C(node_steps) filter), for C(status.json).
    type: dict
    default: {}
  distributed:
    description:
      - The model's C(distributed) section (the C(model_distributed) filter); its C(launcher) sets MAD's variables.
    type: dict
    default: {}
  allocation_nodes:
    description: The allocation's nodes in rank order (sglang-disagg's node addresses, deepspeed's hostfile).
    type: list
    elements: str
    default: []
  node_addresses:
    description:
      - The site config's address of each node, else its name resolves it (loopback refused); sglang-disagg only.
    type: dict
    default: {}
  provenance:
    description: What the perf row says of the image (C(docker_image), C(docker_sha)...), from the build manifest.
    type: dict
    default: {}
  hang_timeout:
    description: Seconds without progress on any rank before rank 0 calls the run hung (docs/hangs.md); 0 turns it off.
    type: float
    default: 300.0
  tools:
    description:
      - The context's C(tools), MAD's list of tools by C(name) with optional C(cmd) and C(env_vars) (docs/tools.md).
    type: list
    elements: raw
    default: []
  tools_file:
    description: MAD's tools.json defining O(tools) by name, over slurm-multi's own tools (a missing file - only those).
    type: path
  heartbeat_stale:
    description: Seconds rank 0's heartbeat may stand still before a worker takes rank 0 for lost; 0 watches nothing.
    type: float
    default: 0
  heartbeat:
    description:
      - Which heartbeat shows rank 0 alive - its ansible-playbook's (C(playbook), pull mode) or this module's
        (C(module)).
    type: str
    choices: [playbook, module]
    default: playbook
  barrier:
    description:
      - Meet the other nodes at M(rank_barrier)'s rank-0 barrier right before the container starts; omitted - none.
    type: dict
    suboptions:
      token:
        description: The run's barrier token (M(rank_barrier)'s O(rank_barrier#module:token)); never logged.
        type: str
        required: true
      timeout:
        description: Seconds the barrier may take overall, on every rank.
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
attributes:
  check_mode:
    support: full
    details:
      - Validates the options and the secrets file and returns the C(docker run) argv; starts nothing.
  diff_mode:
    support: none
notes:
  - Container environment variables, secrets included, are visible to whoever may C(docker inspect) on the node.
  - On shared storage, ranks writing the same O(multiple_results) path overwrite each other; give each node its own
    O(model_dir).
"""

EXAMPLES = r"""
- name: Run the model container on every node
  run_model:
    job_id: "{{ slurm_job_id }}"
    rank: "{{ node_rank }}"
    nnodes: "{{ nnodes }}"
    model: "{{ model_card.name }}"
    image: "{{ image_id }}"
    model_dir: "{{ node_dir }}/workspace"
    scripts: "{{ models_file | dirname }}/{{ model_card.scripts }}"
    results_dir: "{{ results_dir }}"
    master_addr: "{{ master_addr }}"
    master_port: "{{ master_port }}"
    secrets_file: "{{ job_private_dir }}/secrets.env"
  register: model_run
"""

RETURN = r"""
container:
  description: The container's name.
  returned: always
  type: str
  sample: slurm-multi-4242-r1
status:
  description: The node's status, as written to status.json (docs/contracts.md); not returned in check mode.
  returned: success
  type: dict
  sample: {"node": "node2", "rank": 1, "status": "FAILURE", "exit_code": 143, "aborted_by_rank": 0,
           "reason": "aborted because rank 0 (node1) failed: the container exited with code 1"}
log_path:
  description: The node's run.log.
  returned: success
  type: str
  sample: /shared/results/4242/attempt-0/nodes/node2/run.log
status_path:
  description: The node's status.json.
  returned: success
  type: str
  sample: /shared/results/4242/attempt-0/nodes/node2/status.json
diagnostics_path:
  description: The node's diagnostics.txt, when the run failed and the snapshot was written; else null.
  returned: success
  type: str
  sample: /shared/results/4242/attempt-0/nodes/node2/diagnostics.txt
results_csv:
  description: The multiple-results CSV copied into the node dir (the first of O(multiple_results)'s files), or null.
  returned: success
  type: str
  sample: /shared/results/4242/attempt-0/nodes/node2/perf_dummy.csv
results_csvs:
  description: Every results CSV the run wrote (O(multiple_results) and each local rank's), copied into the node dir.
  returned: success
  type: list
  elements: str
  sample: [/shared/results/4242/attempt-0/nodes/node2/perf_dummy_rank0.csv]
docker_run_argv:
  description:
    - The argv that starts the rank (C(docker run ...), or C(ch-run ...) under Charliecloud); the private env file as a
      placeholder.
  returned: always
  type: list
  elements: str
  sample: ["docker", "run", "-d", "--init", "--name", "slurm-multi-4242-r1", "..."]
barrier:
  description: What the barrier before the container gave (as M(rank_barrier) returns it), with O(barrier) only.
  returned: success, with O(barrier)
  type: dict
  sample: {"port": 24817, "waited_seconds": 0.41, "workers": [], "rejected": []}
aborted_by_rank:
  description: The rank whose failure ended the barrier (this node only stopped for it).
  returned: failure at the barrier, when another node failed
  type: int
  sample: 0
env_file_variables:
  description: Names (never values) of the variables passed through the env file.
  returned: always
  type: list
  elements: str
  sample: ["HF_HOME", "MAD_SECRETS_HFTOKEN"]
"""

import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import BarrierFailed
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.node import (
    DEFAULT_PORT_CANDIDATES,
    NodeAtBarrier,
    barrier_logger,
    meet_every_node,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import DEFAULT_TIMEOUT
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import DEFAULT_PORT_RANGE
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import HEARTBEATS, node_liveness
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import current_user
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.cancellation import (
    Cancellation,
    install_cancel_handlers,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import MADENGINE_GUEST_OS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import run_model_container
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRun,
    ModelRunError,
    plan_model_run,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_scripts import copy_scripts, scripts_source
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import DEFAULT_ERROR_PATTERNS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import by_name

ARGUMENT_SPEC = dict(
    job_id=dict(type="str", required=True),
    rank=dict(type="int", required=True),
    nnodes=dict(type="int", required=True),
    node=dict(type="str"),
    model=dict(type="str", required=True),
    image=dict(type="str", required=True),
    image_id=dict(type="str", default=""),
    container_runtime=dict(type="str", default=SETTING_DEFAULTS["container_runtime"]),
    model_dir=dict(type="path", required=True),
    script=dict(type="str"),
    scripts=dict(type="path"),
    model_args=dict(type="raw", default=""),
    results_dir=dict(type="path", required=True),
    attempt=dict(type="int", default=0),
    master_addr=dict(type="str", required=True),
    master_port=dict(type="int", required=True),
    user=dict(type="str"),
    docker_env_vars=dict(type="dict", default={}),
    docker_mounts=dict(type="dict", default={}),
    data_mounts=dict(type="list", elements="str", default=[]),
    additional_docker_run_options=dict(type="raw", default=""),
    gpu_vendor=dict(type="str"),
    guest_os=dict(type="str", default=MADENGINE_GUEST_OS),
    gpus=dict(type="list", elements="dict", default=[]),
    secrets_file=dict(type="path", no_log=False),
    timeout=dict(type="float"),
    job_end_time=dict(type="float"),
    end_margin=dict(type="float", default=float(SETTING_DEFAULTS["job_end_margin"])),
    error_patterns=dict(type="list", elements="str"),
    multiple_results=dict(type="str"),
    n_gpus=dict(type="int", default=-1),
    skip_gpu_arch=dict(type="list", elements="str", default=[]),
    stop_grace=dict(type="int", default=10),
    diagnostics_log_dirs=dict(type="list", elements="str", default=["/run_logs"]),
    steps=dict(type="dict", default={}),
    distributed=dict(type="dict", default={}),
    allocation_nodes=dict(type="list", elements="str", default=[]),
    node_addresses=dict(type="dict", default={}),
    provenance=dict(type="dict", default={}),
    heartbeat_stale=dict(type="float", default=0),
    hang_timeout=dict(type="float", default=float(SETTING_DEFAULTS["hang_timeout"])),
    tools=dict(type="list", elements="raw", default=[]),
    tools_file=dict(type="path"),
    heartbeat=dict(type="str", default="playbook", choices=list(HEARTBEATS)),
    barrier=dict(
        type="dict",
        options=dict(
            token=dict(type="str", required=True, no_log=True),
            timeout=dict(type="float", default=DEFAULT_TIMEOUT),
            port_range=dict(type="str", default="{}-{}".format(*DEFAULT_PORT_RANGE)),
            port_candidates=dict(type="int", default=DEFAULT_PORT_CANDIDATES),
        ),
    ),
)
# Options about this call, not the run's description (ModelRun).
CALL_OPTIONS = ("scripts", "heartbeat_stale", "heartbeat", "barrier", "container_runtime", "image_id")


def node_at_barrier(params: dict, run: ModelRun, image_id: str) -> NodeAtBarrier:
    """This node at the barrier before its container: the run's own options, and the barrier's; ``image_id`` the
    identity this node announces."""
    return NodeAtBarrier(
        rank=run.rank,
        nnodes=run.nnodes,
        master_addr=run.master_addr,
        master_port=run.master_port,
        job_id=run.job_id,
        image_id=image_id,
        hosts=run.allocation_nodes,
        job_dir=run.attempt_dir,
        heartbeat_stale=params["heartbeat_stale"],
        heartbeat=params["heartbeat"],
        **params["barrier"],
    )


def model_run_from_params(params: dict) -> ModelRun:
    """The run's description from the module's options."""
    options = {name: value for name, value in params.items() if value is not None and name not in CALL_OPTIONS}
    options.setdefault("node", socket.gethostname().split(".")[0])
    options.setdefault("user", current_user())
    options.setdefault("error_patterns", list(DEFAULT_ERROR_PATTERNS))
    return ModelRun(**options)


def run_module(module: AnsibleModule) -> None:
    """Plan (check mode) or run this node's container and report its verdict."""
    params = dict(module.params)
    if params["scripts"]:
        scripts_dir, params["script"] = scripts_source(params["scripts"])
        if module.check_mode:
            params["model_dir"] = scripts_dir  # nothing is copied: plan against what would be
        else:
            copy_scripts(scripts_dir, [params["model_dir"]])
    runtime = by_name(params["container_runtime"])
    params["image"] = runtime.image_to_run(params["image"], params["image_id"])
    run = model_run_from_params(params)
    plan = plan_model_run(run, runtime.plan)
    if params["heartbeat_stale"] < 0:
        module.fail_json(
            msg=f"heartbeat_stale must be 0 (off) or a positive number of seconds, got {params['heartbeat_stale']!r}",
            changed=False,
        )
    if params["heartbeat_stale"] and run.nnodes > 1 and not run.allocation_nodes:
        module.fail_json(
            msg="heartbeat_stale needs allocation_nodes, the allocation's nodes in rank order: rank 0's heartbeat "
            "is in the first one's node dir",
            changed=False,
        )
    liveness = node_liveness(
        run.attempt_dir, run.allocation_nodes, run.rank, params["heartbeat"], params["heartbeat_stale"]
    )
    for warning in plan["warnings"]:
        module.warn(warning)
    result = dict(
        container=plan["container"],
        docker_run_argv=plan["docker_run_argv"],
        env_file_variables=plan["env_file_variables"],
    )
    if module.check_mode:
        module.exit_json(changed=True, msg="check mode: no container was started", **result)
    meet_other_nodes = None
    if params["barrier"]:
        image_id = runtime.announced_identity(run)
        if image_id is None:
            module.fail_json(
                msg=f"image {run.image} is not ready on {run.node} under {runtime.name}: the build stage makes it so",
                changed=False,
                **result,
            )
        node, logger = node_at_barrier(params, run, image_id), barrier_logger(module)

        def meet_other_nodes():
            return meet_every_node(node, logger, liveness.watch)

    cancellation = Cancellation()
    restore_signals = install_cancel_handlers(cancellation)
    try:
        outcome = run_model_container(run, cancellation, liveness, meet_other_nodes, runtime=runtime)
    except ModelRunError as error:
        module.fail_json(msg=str(error), changed=False, **result)
    except BarrierFailed as failure:
        for warning in failure.fields.pop("warnings", []):
            module.warn(warning)
        module.fail_json(msg=str(failure), changed=False, **dict(result, **failure.fields))
    finally:
        restore_signals()
    if outcome.barrier is not None:
        for warning in outcome.barrier.pop("warnings", []):
            module.warn(warning)
        result["barrier"] = outcome.barrier
    for warning in outcome.warnings:
        module.warn(warning)
    result.update(
        changed=outcome.started,
        status=outcome.status,
        log_path=outcome.log_path,
        status_path=outcome.status_path,
        diagnostics_path=outcome.diagnostics_path,
        results_csv=outcome.results_csv,
        results_csvs=outcome.results_csvs,
    )
    if outcome.status["cancelled"]:
        module.fail_json(msg=f"{plan['container']}: {outcome.status['reason']}", **result)
    module.exit_json(**result)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        supports_check_mode=True,
        mutually_exclusive=[("script", "scripts")],
        required_one_of=[("script", "scripts")],
    )
    run_reporting_unexpected_errors(module, run_module, "run_model", changed=False)


if __name__ == "__main__":
    main()
