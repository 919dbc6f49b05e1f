"""What the preparation stage learns about a node, from the node itself: Ansible's fact gathering would copy the
whole environment (secrets included) into variables and cost an srun step of its own."""

from __future__ import annotations

import getpass
import os
import socket
from typing import Any, Mapping

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import allocated_gpu_indices
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.facts import detect_gpus
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import (
    current_user,
    remove_stale_containers,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import routable_addresses
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class NodeNotReady(UserError):
    """The node cannot take part in the run; the message names the node, the cause and the fix."""


def docker_server_version(node: str) -> str:
    """The node's Docker daemon version; NodeNotReady when the daemon does not answer."""
    version = docker_api.server_version()
    if version is not None:
        return version
    try:
        result = run_docker(["version", "--format", "{{.Server.Version}}"], timeout=30)
    except DockerError as exc:
        raise NodeNotReady(
            f"Docker on {node} is not reachable ({exc.stderr_tail or exc.problem}); start dockerd on {node} "
            "or fix DOCKER_HOST / the socket's permissions for this user"
        ) from None
    return result.stdout.strip()


def prepare_node_dir(results_dir: str, job_id: str, node: str, attempt: int = 0) -> str:
    """Create the node's own results directory for this attempt, every directory on the way checked
    (make_job_dirs refuses one another user owns or could write), and return it."""
    try:
        node_dir = job_layout.node_dir(results_dir, job_id, attempt, node)
        results_dir_trust.make_job_dirs(node_dir, results_dir)
    except job_layout.JobLayoutError as exc:
        raise NodeNotReady(f"{exc} (on {node})") from None
    if not os.access(node_dir, os.W_OK):
        raise NodeNotReady(f"the results directory {node_dir} is not writable by {getpass.getuser()} on {node}")
    return node_dir


def node_facts(
    node: str,
    results_dir: str,
    job_id: str,
    resolve_master: bool,
    attempt: int = 0,
    master_host: str = "",
    docker: bool = True,
) -> dict:
    """The facts of this node the run needs; NodeNotReady when it cannot take part. With ``resolve_master``,
    ``routable_addresses`` lists rank 0's: ``master_host``'s, or this node's own when empty (rank 0 itself). Without
    ``docker`` (a runtime with no daemon) no daemon is asked: ``docker_version`` is None."""
    gpus = detect_gpus()
    facts = {
        "hostname": socket.gethostname(),
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME", ""),
        "user": getpass.getuser(),
        "uid": os.getuid(),
        "docker_version": docker_server_version(node) if docker else None,
        "gpu_vendor": gpus["vendor"],
        "gpus": gpus["gpus"],
        "allocated_gpus": allocated_gpu_indices(os.environ),
        "warnings": gpus["warnings"],
        "node_dir": prepare_node_dir(results_dir, job_id, node, attempt),
        "attempt_dir": job_layout.attempt_dir(results_dir, job_id, attempt),
        "routable_addresses": [],
    }
    if resolve_master:
        facts["routable_addresses"] = routable_addresses(master_host or socket.gethostname())
    return facts


# The options of the node_facts module, which node_preflight also takes (its `node_facts`: the preflight stage's
# round reads the facts too, and the preparation stage hands them on without a round of its own).
NODE_FACTS_OPTIONS = dict(
    node=dict(type="str", required=True),
    results_dir=dict(type="path", required=True),
    job_id=dict(type="str", required=True),
    attempt=dict(type="int", default=0),
    resolve_master=dict(type="bool", default=False),
    master_host=dict(type="str", default=""),
    remove_stale_containers=dict(type="bool", default=False),
    container_runtime=dict(type="str", default="docker"),
)


def read_node(options: Mapping[str, Any], check_mode: bool = False) -> dict:
    """The node_facts module's result for ``options`` (NODE_FACTS_OPTIONS); NodeNotReady when the node cannot take
    part."""
    node = options["node"]
    facts = node_facts(
        node,
        options["results_dir"],
        options["job_id"],
        options["resolve_master"],
        attempt=options["attempt"],
        master_host=options["master_host"],
        docker=options["container_runtime"] == "docker",
    )
    result = dict(facts, gpu_warnings=facts.pop("warnings"), changed=False, warnings=[])
    if options["remove_stale_containers"]:
        # After node_facts checked that the daemon answers: this call's failures are the cleanup's own.
        try:
            cleanup = remove_stale_containers(current_user(), check_mode=check_mode)
        except DockerError as error:
            raise NodeNotReady(f"cannot clean up stale containers on {node}: {error}") from None
        result.update(stale_containers=cleanup.as_result(), changed=bool(cleanup.removed), warnings=cleanup.warnings)
    return result
