"""A lab node that lacks what a site's node may lack: FUSE for its users, or a command (Charliecloud's ch-run).

Inside the node's own mount namespace a root-owned file of mode 0000 is bound over the path, so a user on that node
can neither open nor run it, as on a site whose node refuses FUSE ("fuse: failed to open /dev/fuse: Permission
denied") or has no Charliecloud; the other nodes and the machine keep it. ``hidden`` restores it on leaving, as
``restore`` does.
"""

import contextlib
import subprocess
from pathlib import Path

from slurm_multi.lab.cluster import LabError, LabNode, running_pid

FUSE_DEVICE = "/dev/fuse"
CH_RUN = "/usr/bin/ch-run"


def refusing_file(node: LabNode) -> Path:
    """The root-owned file of mode 0000 bound over a hidden path of the node."""
    return node.dir / "hidden-path"


def _in_node(node: LabNode, argv: list[str]) -> subprocess.CompletedProcess:
    holder = running_pid(f"{node.name}-holder", "sleep")
    if holder is None:
        raise LabError(f"{node.name} is not up: run `slurm-multi lab up`")
    return subprocess.run(["nsenter", "-t", str(holder), "-m", *argv], capture_output=True, text=True)


def is_hidden(node: LabNode, path: str) -> bool:
    """Whether the node's `path` is the refusing file."""
    refusing = refusing_file(node)
    if not refusing.exists():
        return False
    seen = _in_node(node, ["stat", "-c", "%d:%i", path]).stdout.strip()
    return seen == f"{refusing.stat().st_dev}:{refusing.stat().st_ino}"


def hide(node: LabNode, path: str) -> None:
    """The node's users can neither open nor run `path` (root still can: the tests' users are not root)."""
    refusing = refusing_file(node)
    refusing.touch()
    refusing.chmod(0)
    if is_hidden(node, path):
        return
    bound = _in_node(node, ["mount", "--bind", str(refusing), path])
    if bound.returncode != 0:
        raise LabError(f"{node.name}: cannot hide {path}: {bound.stderr.strip()}")


def restore(node: LabNode, path: str) -> None:
    """The node's `path` is its own again."""
    while is_hidden(node, path) and _in_node(node, ["umount", path]).returncode == 0:
        pass
    if is_hidden(node, path):
        raise LabError(f"{node.name}: cannot restore {path}; restart its namespaces with `slurm-multi lab down`")


@contextlib.contextmanager
def hidden(nodes: list[LabNode], path: str):
    """`path` hidden on `nodes` for the block's duration."""
    try:
        for node in nodes:
            hide(node, path)
        yield
    finally:
        for node in nodes:
            restore(node, path)
