"""A container's block I/O from its cgroup (module_utils/run/hang/cgroup_block_io.py): found from its processes, read by
any user, and what the kernel's two layouts write.

The real container runs on the session's private Docker daemon; this machine's layout (cgroup v1's blkio beside a
unified hierarchy without the io controller, Docker's cgroupfs driver) is the one read there. A v2 host's files
are laid out in a tree of the test's own, named by a mountinfo line as the kernel writes it.
"""

import os
import time
import uuid

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.cgroup_block_io import (
    V2_FILE,
    block_io_file,
    read_block_io_bytes,
)
from tests.support.lab.slow_disk import SLOW_READ_SCRIPT
from tests.support.users.local_users import USER, ensure_user, run_as

IO_STAT = "254:0 rbytes=4194304 wbytes=1048576 rios=64 wios=16 dbytes=0 dios=0\n7:0 rbytes=512 wbytes=0 rios=1 wios=0\n"


def _mountinfo(tmp_path, root: str, mounted_at) -> str:
    """A mountinfo with the unified cgroup hierarchy (cgroup2) mounted at ``mounted_at``, from its ``root``."""
    path = tmp_path / "mountinfo"
    path.write_text(
        "23 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"35 23 0:30 {root} {mounted_at} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"
    )
    return str(path)


def _own_v2_cgroup() -> str:
    with open("/proc/self/cgroup") as listed:
        return next(line.split(":", 2)[2].strip() for line in listed if line.startswith("0::"))


def test_a_containers_cgroup_counts_the_disk_reads_of_its_processes(private_dockerd, busybox_image):
    container = f"slurm-multi-test-block-io-{uuid.uuid4().hex[:8]}"
    private_dockerd.docker("run", "-d", "--name", container, busybox_image[0], "sh", "-c", SLOW_READ_SCRIPT, "sh", "8")
    try:
        deadline = time.monotonic() + 60
        while "read\n" not in private_dockerd.docker("logs", container).stdout:
            assert time.monotonic() < deadline, private_dockerd.docker("logs", container).stderr
            time.sleep(0.2)
        listed = private_dockerd.docker("top", container, "-eo", "pid").stdout.split()[1:]
        pids = [int(pid) for pid in listed]
        path = block_io_file(pids)
        assert private_dockerd.docker("inspect", "--format", "{{.Id}}", container).stdout.strip() in path
        counted = read_block_io_bytes(path)
        assert counted >= 8 << 20  # its shard, read past the page cache
        # Any user may read it: the job's user, whose /proc/<pid>/io of these root processes is closed.
        ensure_user(USER)
        read_as_user = run_as(USER, ["cat", path])
        assert read_as_user.returncode == 0, read_as_user.stderr
        assert run_as(USER, ["cat", f"/proc/{pids[0]}/io"]).returncode != 0
    finally:
        private_dockerd.docker("rm", "-f", container, check=False)


def test_on_cgroup_v2_the_cgroups_io_stat_is_read_and_its_bytes_summed(tmp_path):
    tree = tmp_path / "unified"
    cgroup = tree / _own_v2_cgroup().lstrip("/")
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / V2_FILE).write_text(IO_STAT)
    path = block_io_file([os.getpid()], mountinfo=_mountinfo(tmp_path, "/", tree))
    assert path == str(cgroup / V2_FILE)
    assert read_block_io_bytes(path) == 4194304 + 1048576 + 512


def test_cgroup_v1s_counters_sum_every_devices_reads_and_writes(tmp_path):
    counters = tmp_path / "blkio.throttle.io_service_bytes_recursive"
    counters.write_text(
        "254:0 Read 8585216\n254:0 Write 4096\n254:0 Sync 0\n254:0 Async 8589312\n254:0 Discard 0\n"
        "254:0 Total 8589312\n7:0 Read 512\n7:0 Write 0\n7:0 Total 512\nTotal 8589824\n"
    )
    assert read_block_io_bytes(str(counters)) == 8585216 + 4096 + 512


def test_a_cgroup_outside_the_mounted_part_of_the_hierarchy_has_no_counters(tmp_path):
    # A cgroup namespace, or a mount of a subtree: this process's cgroup lies outside /elsewhere.
    tree = tmp_path / "unified"
    tree.mkdir()
    (tree / V2_FILE).write_text(IO_STAT)
    assert block_io_file([os.getpid()], mountinfo=_mountinfo(tmp_path, "/elsewhere", tree)) is None
    assert read_block_io_bytes(str(tmp_path / "gone" / V2_FILE)) is None
