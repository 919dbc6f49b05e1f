"""A lab node seen from outside, for tests that check what a node's own Docker daemon holds or runs."""

import subprocess

from slurm_multi.lab import cluster as lab


def node_docker_host(name: str) -> str:
    """DOCKER_HOST of lab node ``name``'s (``node1``, ``node2``...) Docker daemon."""
    return f"unix://{lab.LabNode(int(name.removeprefix('node'))).docker_socket}"


def name_the_base_by_a_registry_digest(node: str = "node1") -> None:
    """Push the lab's base image once from `node` to the lab registry: its daemon then knows the base's layers by a
    registry digest, as a daemon that pulled its base (`rocm/pytorch`) from a registry does. The lab builds its base
    on each node, which no push can skip (module_utils/image/cache/push_target.py)."""
    remote = f"{lab.registry_url()}/{lab.BASE_IMAGE}"
    for args in (["tag", lab.BASE_IMAGE, remote], ["push", remote], ["rmi", remote]):
        subprocess.run(
            ["docker", "--host", node_docker_host(node), *args], check=True, capture_output=True, timeout=120
        )
