"""A rank that is a host process tree (a daemonless runtime's ``ch-run`` and what it started), read from /proc: its
processes, their listening sockets, and the pid file by which `slurm-multi stacks` finds a running rank."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Set, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically

# Beside the node's run.log while the rank runs: {"pid", "started", "rank", "container"} of the rank's first process.
RANK_PID_FILE = "rank-process.json"
_TCP_LISTEN = "0A"


def _stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat after the command's closing parenthesis: state is field 0, ppid 1, pgrp 2, starttime 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].decode("ascii", "replace").split()
    except OSError:
        return None


def start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot: with the pid, it names one process (pids are reused)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _parents() -> Dict[int, Tuple[int, int]]:
    """{pid: (ppid, process group)} of every process in sight."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields and len(fields) > 2:
                table[int(name)] = (int(fields[1]), int(fields[2]))
    return table


def tree_pids(root: int, group: Optional[int] = None) -> List[int]:
    """``root`` and every descendant of it, and (``group``) every member of that process group, alive now; sorted."""
    table = _parents()
    found = {root} if root in table else set()  # type: Set[int]
    if group is not None:
        found |= {pid for pid, (_, pgrp) in table.items() if pgrp == group}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        found |= children
        grew = bool(children)
    return sorted(found)


def command_line(pid: int) -> str:
    """The process's argv as one line ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def listing(pids: List[int]) -> Tuple[str, List[Tuple[int, int, str]]]:
    """(a ``ps``-like table, [(pid, ppid, command)]) of ``pids``, those gone meanwhile left out."""
    rows = []
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is None or len(fields) < 2:
            continue
        rows.append((pid, int(fields[1]), fields[0], command_line(pid)))
    text = ["PID PPID STATE COMMAND"] + [f"{pid} {ppid} {state} {command}" for pid, ppid, state, command in rows]
    return "\n".join(text), [(pid, ppid, command) for pid, ppid, _, command in rows]


def _socket_inodes(pid: int) -> Set[str]:
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> str:
    host, _, port = hex_address.partition(":")
    if len(host) == 8:
        address = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        address = "[" + ":".join(host[i : i + 4] for i in range(0, len(host), 4)) + "]"
    return f"{address}:{int(port, 16)}"


def listening_sockets(pids: List[int]) -> List[str]:
    """``<address:port> pid <pid>`` of each TCP socket the processes listen on (the node's network: a runtime sharing
    the host's, as ch-run does, shows them in the host's tables)."""
    owners = {}  # type: Dict[str, int]
    for pid in pids:
        for inode in _socket_inodes(pid):
            owners.setdefault(inode, pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pids[0] if pids else 'self'}/net/{table}") as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _TCP_LISTEN and fields[9] in owners:
                found.append(f"{_address(fields[1])} pid {owners[fields[9]]}")
    return found


def write_rank_pid_file(node_dir: str, pid: int, rank: int, container: str) -> str:
    """Name the rank's first process beside its log (`slurm-multi stacks` finds a running rank by it)."""
    path = os.path.join(node_dir, RANK_PID_FILE)
    record = {"pid": pid, "started": start_time(pid), "rank": rank, "container": container}
    write_file_atomically(path, json.dumps(record).encode("utf-8"))
    return path


def running_rank(node_dir: str) -> Optional[Dict[str, object]]:
    """The rank named by the node dir's pid file while that very process still runs (same pid and start time); None
    when there is none or it ended (its pid may be another process's by now)."""
    try:
        with open(os.path.join(node_dir, RANK_PID_FILE), encoding="utf-8") as named:
            record = json.load(named)
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("started") is None or start_time(pid) != record.get("started"):
        return None
    return record
