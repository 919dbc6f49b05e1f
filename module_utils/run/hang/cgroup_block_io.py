"""A container's block I/O as its cgroup counts it: the hang watchdog's storage progress where /proc/<pid>/io is
closed to the job's user. cgroup v2's ``io.stat``, else v1's ``blkio.throttle.io_service_bytes_recursive``."""

from __future__ import annotations

import os
from typing import Dict, Iterable, Optional, Tuple

V2_FILE = "io.stat"
V1_FILE = "blkio.throttle.io_service_bytes_recursive"


def _unescaped(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash come octal-escaped (``\\040``)."""
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, plain)
    return field


def _cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> Dict[str, Tuple[str, str]]:
    """{"v2": (its root, where it is mounted), "v1": (...)} of the cgroup file systems this process sees: the
    unified one and v1's blkio hierarchy, each where mounted."""
    mounts: Dict[str, Tuple[str, str]] = {}
    try:
        with open(mountinfo) as table:
            lines = table.read().splitlines()
    except OSError:
        return mounts
    for line in lines:
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            kind, options = fields[separator + 1], fields[separator + 3]
        except (ValueError, IndexError):
            continue
        if kind == "cgroup2":
            mounts.setdefault("v2", (_unescaped(fields[3]), _unescaped(fields[4])))
        elif kind == "cgroup" and "blkio" in options.split(","):
            mounts.setdefault("v1", (_unescaped(fields[3]), _unescaped(fields[4])))
    return mounts


def _process_cgroups(pid: int) -> Dict[str, str]:
    """{"v2": the process's cgroup in the unified hierarchy, "v1": in blkio's}, as /proc/<pid>/cgroup names them."""
    cgroups: Dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/cgroup") as listed:
            lines = listed.read().splitlines()
    except OSError:
        return cgroups
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            cgroups["v2"] = path
        elif "blkio" in controllers.split(","):
            cgroups["v1"] = path
    return cgroups


def _counter_file(mount: Tuple[str, str], cgroup: str, name: str) -> Optional[str]:
    """``name`` in ``cgroup``'s directory under ``mount``; None when the cgroup lies outside what is mounted (another
    cgroup namespace's: /proc/<pid>/cgroup then reads ``/..``) or has no such file."""
    root, mounted_at = mount
    if root != "/":
        if cgroup != root and not cgroup.startswith(root.rstrip("/") + "/"):
            return None
        cgroup = cgroup[len(root.rstrip("/")) :]
    parts = [part for part in cgroup.split("/") if part]
    if ".." in parts:
        return None
    path = os.path.join(mounted_at, *parts, name)
    return path if os.path.isfile(path) else None


def block_io_file(pids: Iterable[int], mountinfo: str = "/proc/self/mountinfo") -> Optional[str]:
    """The counters' file of the processes' cgroup (the outermost of theirs: a container's processes share one,
    unless one of them made its own below it), or None where none can be read."""
    mounts = _cgroup_mounts(mountinfo)
    found = []
    for pid in pids:
        cgroups = _process_cgroups(pid)
        for version, name in (("v2", V2_FILE), ("v1", V1_FILE)):
            if version in mounts and version in cgroups:
                path = _counter_file(mounts[version], cgroups[version], name)
                if path:
                    found.append(path)
                    break
    return min(found, key=len) if found else None


def read_block_io_bytes(path: str) -> Optional[int]:
    """Bytes read from and written to block devices, summed over the devices, from ``io.stat`` or the v1 file; None
    when it cannot be read (the cgroup is gone with its container)."""
    try:
        with open(path) as counters:
            lines = counters.read().splitlines()
    except OSError:
        return None
    total = 0
    try:
        for line in lines:
            counts = line.split()[1:]  # after the device
            if path.endswith(V2_FILE):  # 8:0 rbytes=1 wbytes=2 rios=3 wios=4 dbytes=0 dios=0
                pairs = (count.partition("=") for count in counts)
                total += sum(int(value) for name, _, value in pairs if name in ("rbytes", "wbytes"))
            elif len(counts) == 2 and counts[0] in ("Read", "Write"):  # 8:0 Read 1, ...; Total 3
                total += int(counts[1])
    except ValueError:
        return None
    return total
