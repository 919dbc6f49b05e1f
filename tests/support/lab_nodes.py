"""A lab node seen from outside, for tests that check what a node's own Docker daemon holds or runs."""

from slurm_multi.lab import cluster as lab


def node_docker_host(name: str) -> str:
    """DOCKER_HOST of lab node ``name``'s (``node1``, ``node2``...) Docker daemon."""
    return f"unix://{lab.LabNode(int(name.removeprefix('node'))).docker_socket}"
