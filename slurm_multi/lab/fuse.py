"""A lab node without FUSE, as many sites' nodes are: its users cannot mount a squashfs image and must unpack it.

Inside the node's own mount namespace a root-owned file of mode 0000 is bound over /dev/fuse, so a user's `ch-run`
of a squashfs file there fails as on such a site ("fuse: failed to open /dev/fuse: Permission denied"); the other
nodes and the machine keep their FUSE. ``fuse_refused`` restores it on leaving, as ``restore_fuse`` does.
"""

import contextlib
import subprocess
from pathlib import Path

from slurm_multi.lab.cluster import LabError, LabNode, running_pid

FUSE_DEVICE = "/dev/fuse"


def refusing_file(node: LabNode) -> Path:
    """The root-owned file of mode 0000 bound over the node's /dev/fuse."""
    return node.dir / "no-fuse"


def _holder(node: LabNode) -> int:
    pid = running_pid(f"{node.name}-holder", "sleep")
    if pid is None:
        raise LabError(f"{node.name} is not up: run `slurm-multi lab up`")
    return pid


def _in_node(node: LabNode, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(_holder(node)), "-m", *argv], capture_output=True, text=True)


def fuse_hidden(node: LabNode) -> bool:
    """Whether the node's /dev/fuse is the refusing file rather than the device."""
    return _in_node(node, ["stat", "-c", "%F", FUSE_DEVICE]).stdout.strip() != "character special file"


def hide_fuse(node: LabNode) -> None:
    """The node's users can open no /dev/fuse (root still can: the tests' users are not root)."""
    if fuse_hidden(node):
        return
    refusing = refusing_file(node)
    refusing.touch()
    refusing.chmod(0)
    bound = _in_node(node, ["mount", "--bind", str(refusing), FUSE_DEVICE])
    if bound.returncode != 0:
        raise LabError(f"{node.name}: cannot hide {FUSE_DEVICE}: {bound.stderr.strip()}")


def restore_fuse(node: LabNode) -> None:
    """The node's /dev/fuse is the device again."""
    while fuse_hidden(node) and _in_node(node, ["umount", FUSE_DEVICE]).returncode == 0:
        pass
    if fuse_hidden(node):
        raise LabError(f"{node.name}: cannot restore {FUSE_DEVICE}; restart its namespaces with `slurm-multi lab down`")


@contextlib.contextmanager
def fuse_refused(nodes: list[LabNode]):
    """`nodes` without FUSE for the block's duration."""
    try:
        for node in nodes:
            hide_fuse(node)
        yield
    finally:
        for node in nodes:
            restore_fuse(node)
