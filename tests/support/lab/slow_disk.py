"""Slow storage for a container: `docker run --device-read-bps` on the disk under the daemon's data root.

The kernel's block throttle (the container's blkio/io cgroup) then holds each of the container's reads from that
disk to the rate: a read that bypasses the page cache (O_DIRECT) sits in uninterruptible sleep (state D), using no
CPU, while its bytes advance slowly; what a rank reading from a busy shared disk does. The rate applies to a whole
disk, not a partition, and only to reads that reach it.
"""

import os
from pathlib import Path

import pytest

# The rank's shard: written at full speed (writes are not throttled), then read back past the page cache.
SLOW_READ_SCRIPT = (
    'mkdir -p /tmp && dd if=/dev/zero of=/tmp/shard bs=1M count="$1" conv=fsync 2>/dev/null && echo reading'
    " && dd if=/tmp/shard of=/dev/null bs=64k iflag=direct 2>/dev/null && echo read && exec sleep 600"
)


def whole_disk(path: str) -> str | None:
    """The block device (/dev/...) of the whole disk that holds ``path``, or None (a file system on no disk)."""
    device = os.stat(path).st_dev
    found = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not found.exists():
        return None
    found = found.resolve()
    if (found / "partition").exists():
        found = found.parent
    node = Path("/dev") / found.name
    return str(node) if node.is_block_device() else None


def throttled_read_options(data_root: str, rate: str = "1mb") -> list[str]:
    """`docker run` options that let a container read the disk under ``data_root`` at ``rate`` per second only;
    skips the test where that disk has no device node to name."""
    disk = whole_disk(data_root)
    if disk is None:
        pytest.skip(f"{data_root} lies on no block device of this machine: nothing to throttle a read from")
    return ["--device-read-bps", f"{disk}:{rate}"]
