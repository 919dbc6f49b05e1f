"""Every process's stacks of a running model container, taken from the host with ``py-spy dump`` (docs/hangs.md).

Only RANK and LOCAL_RANK are read from /proc/<pid>/environ (it holds the job's secrets), and a frame's file is
resolved inside the process's root, never on the host (`open_source_file`). Written masked as ``stacks.txt`` and
``stacks.json``."""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import errno
import json
import os
import socket
import stat
import subprocess
import sys
import time
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import is_secret_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import LABEL_PREFIX
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run import process_tree
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import STACKS_JSON, STACKS_TEXT
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import find_pyspy
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

NOT_PYTHON = "not a Python process"
# What a user whose py-spy may not read a rank can do, safely; docs/hangs.md says the same and why. A ptrace
# capability on py-spy (setcap) is no such way: whoever may run that py-spy reads every process on the node with it.
TRACE_REFUSED = (
    "it belongs to another user (Docker runs a container's processes as root by default). Take the stacks as root, "
    "or run the containers with rootless Docker or Podman: their processes are then the job user's own, which that "
    "user's py-spy reads. Never give py-spy CAP_SYS_PTRACE: whoever may run it could read any process's memory on "
    "the node (docs/hangs.md)"
)
_SOURCE_LINE_LIMIT = 200
# A source file is read this far at most: a frame may name any file, a huge one too.
_SOURCE_BYTES_LIMIT = 4 << 20
# openat2(2), Linux 5.6+: one number on every architecture the nodes run (x86_64, aarch64, ppc64le).
_SYS_OPENAT2 = 437
# RESOLVE_IN_ROOT: "/", ".." and every link met resolve inside the directory given, as if it were the root;
# RESOLVE_NO_MAGICLINKS: no /proc/<pid>/root-style jump out of it either.
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
# py-spy dumps at once: a rank's dataloader workers make dozens of processes, the node has cores for its ranks.
_PARALLEL_DUMPS = 16


def _environ_ranks(pid: int) -> Tuple[Optional[int], Optional[int]]:
    """(RANK, LOCAL_RANK) of a process, None where unset or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError:
        return None, None
    found = {}
    for entry in entries:
        name, _, value = entry.partition(b"=")
        if name in (b"RANK", b"LOCAL_RANK") and value.isdigit():
            found[name] = int(value)
    return found.get(b"RANK"), found.get(b"LOCAL_RANK")


def _rank_credentials(pid: int) -> Optional[Tuple[int, FrozenSet[int]]]:
    """(file-system uid, every gid) of a process, from /proc/<pid>/status (readable by anyone)."""
    uid, gids = None, set()
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, values = line.partition(":")
                if name == "Uid":
                    uid = int(values.split()[3])
                elif name == "Gid":
                    gids.add(int(values.split()[3]))
                elif name == "Groups":
                    gids.update(int(value) for value in values.split())
    except (OSError, ValueError, IndexError):
        return None
    return None if uid is None else (uid, frozenset(gids))


def _may_read(found: os.stat_result, uid: int, gids: FrozenSet[int]) -> bool:
    """Whether the owner/group/other read bit lets ``uid`` read the file (root reads all)."""
    if uid == 0:
        return True
    if found.st_uid == uid:
        return bool(found.st_mode & stat.S_IRUSR)
    if found.st_gid in gids:
        return bool(found.st_mode & stat.S_IRGRP)
    return bool(found.st_mode & stat.S_IROTH)


class _OpenHow(ctypes.Structure):
    """openat2's ``struct open_how``."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = None
_openat2_missing = False


def find_in_root(root: int, name: str) -> int:
    """An O_PATH descriptor of ``name`` resolved inside the directory ``root`` (a descriptor) as if it were ``/``
    (openat2's RESOLVE_IN_ROOT; before Linux 5.6 the stricter `find_below_root_without_links`). Raises OSError."""
    global _libc, _openat2_missing
    if not _openat2_missing:
        how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        found = _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(root),
            ctypes.c_char_p(os.fsencode(name)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if found >= 0:
            return found
        error = ctypes.get_errno()
        if error != errno.ENOSYS:
            raise OSError(error, os.strerror(error), name)
        _openat2_missing = True
    return find_below_root_without_links(root, name)


def find_below_root_without_links(root: int, name: str) -> int:
    """An O_PATH descriptor of ``name`` below the directory ``root``, one component at a time, refusing any ``..`` or
    link (PermissionError): outside openat2 an absolute link would resolve against the host's root. Raises OSError."""
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise PermissionError(errno.EACCES, "a name that climbs out of the process's root", name)
    here = os.dup(root)
    try:
        for part in parts:
            step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            os.close(here)
            here = step
            if stat.S_ISLNK(os.fstat(here).st_mode):
                raise PermissionError(errno.EACCES, "a symbolic link on the way (no openat2 to resolve it)", name)
        return here
    except BaseException:
        os.close(here)
        raise


def open_source_file(pid: int, path: str) -> Optional[int]:
    """A read descriptor of ``path`` as process ``pid`` sees it, or None: only a regular file inside /proc/<pid>/root
    that the process itself may read, so the model's file names never reach a host file the rank could not read."""
    credentials = _rank_credentials(pid)
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = find_in_root(root, path)
    except OSError:
        return None
    finally:
        os.close(root)
    try:
        seen = os.fstat(found)
        if credentials is None or not stat.S_ISREG(seen.st_mode) or not _may_read(seen, *credentials):
            return None
        # Opened for reading only now that it is known to be a regular file: the same file, through this process's
        # own descriptor.
        return os.open(f"/proc/self/fd/{found}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(found)


def source_line(pid: int, path: str, line: int, cache: Dict[str, Optional[List[str]]]) -> Optional[str]:
    """Line ``line`` of ``path`` as the process sees it (`open_source_file`); None for a file it has not
    (``<string>``, a zip), may not read, or one past ``_SOURCE_BYTES_LIMIT``'s lines."""
    if not path.startswith("/") or line < 1:
        return None
    if path not in cache:
        cache[path] = None
        descriptor = open_source_file(pid, path)
        if descriptor is not None:
            with os.fdopen(descriptor, "rb") as source:
                try:
                    cache[path] = source.read(_SOURCE_BYTES_LIMIT).decode("utf-8", "replace").splitlines()
                except OSError:
                    pass
    lines = cache[path]
    return lines[line - 1].strip()[:_SOURCE_LINE_LIMIT] if lines and line <= len(lines) else None


def _own_id(status_path: str) -> Optional[int]:
    """A task's id in the innermost PID namespace (its container's): NSpid's last field."""
    try:
        with open(status_path) as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def _host_view(pid: int) -> Tuple[Optional[int], Dict[int, bool]]:
    """(the process's id inside its container, {each thread's id inside the container: running}), from /proc: py-spy
    from the host looks container thread ids up among the host's and calls every such thread active."""
    running = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for task in tasks:
        inner = _own_id(f"/proc/{pid}/task/{task}/status")
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as task_stat:
                state = task_stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if inner is not None:
            running[inner] = state == "R"
    return _own_id(f"/proc/{pid}/status"), running


def parse_pyspy_dump(
    text: str, pid: int, main_thread: Optional[int] = None, running: Optional[Dict[int, bool]] = None
) -> List[Dict[str, object]]:
    """py-spy's ``dump --json`` as stacks.json's threads, main one first, frames innermost first; ``main_thread``: the
    process's id inside its container, ``running``: which threads run (`_host_view`; None: unknown)."""
    threads = []
    cache: Dict[str, Optional[List[str]]] = {}
    for thread in json.loads(text):
        frames = [
            {
                "function": frame.get("name"),
                "file": frame.get("filename"),
                "line": frame.get("line"),
                "source": source_line(pid, str(frame.get("filename") or ""), int(frame.get("line") or 0), cache),
            }
            for frame in thread.get("frames") or []
        ]
        name, os_id = thread.get("thread_name"), thread.get("os_thread_id")
        main = os_id == main_thread if main_thread is not None and os_id is not None else name == "MainThread"
        threads.append(
            {
                "id": str(thread.get("thread_id")),
                "name": name or ("MainThread" if main else None),
                "main": main,
                "idle": None if running is None or os_id not in running else not running[os_id],
                "frames": frames,
            }
        )
    return sorted(threads, key=lambda thread: not thread["main"])


def pyspy_error(stderr: str, pid: int) -> str:
    """Why py-spy could not dump ``pid``, in a line: its own first one, which names the cause (a backtrace and
    "Caused by" follow it when RUST_BACKTRACE is set)."""
    said = next((line.strip() for line in stderr.splitlines() if line.strip()), "py-spy dump failed")
    if "python version" in said.lower():
        return NOT_PYTHON
    if said.lower().startswith("permission denied"):
        # py-spy's own advice ('sudo env "PATH=$PATH" !!') is about a shell this is not.
        return f"py-spy may not read process {pid}: {TRACE_REFUSED}"
    return said[len("Error: ") :] if said.startswith("Error: ") else said


def _dump(pyspy: str, pid: int, deadline: float) -> Tuple[Optional[List[Dict[str, object]]], Optional[str]]:
    """(threads, None) for a Python process, (None, why not) otherwise; given up at ``deadline`` (monotonic)."""
    main_thread, running = _host_view(pid)  # before the dump, which stops the process for its instant
    timeout = max(0.5, deadline - time.monotonic())
    try:
        done = subprocess.run(
            [pyspy, "dump", "--pid", str(pid), "--json"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump gave no answer in {timeout:.0f} s"
    if done.returncode != 0:
        return None, pyspy_error(done.stderr or done.stdout, pid)
    try:
        return parse_pyspy_dump(done.stdout, pid, main_thread, running), None
    except (ValueError, TypeError, AttributeError) as err:
        return None, f"py-spy's output is not the JSON it writes: {err}"


def _container_processes(container: str, timeout: float) -> Tuple[str, List[Tuple[int, int, str]]]:
    """(``docker top``'s text, [(pid, ppid, command)]) of the container."""
    listed = run_docker(["top", container, "-eo", "pid,ppid,args"], timeout=timeout).stdout
    processes = []
    for line in listed.splitlines()[1:]:
        pid, ppid, command = (line.split(None, 2) + ["", ""])[:3]
        if pid.isdigit() and ppid.isdigit():
            processes.append((int(pid), int(ppid), command.strip()))
    return listed.rstrip("\n"), processes


def _log_tail(log_path: Optional[str], lines: int) -> List[str]:
    if not log_path:
        return []
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - 64 * 1024))
            return log.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return []


def take_container_stacks(
    container: str,
    rank: int,
    node: str,
    why: str,
    secret_values: Sequence[str] = (),
    log_path: Optional[str] = None,
    log_lines: int = 20,
    timeout: float = 20.0,
    processes: Optional[Tuple[str, List[Tuple[int, int, str]]]] = None,
) -> Dict[str, object]:
    """The container's stacks as stacks.json holds them, ``secret_values`` masked, every process dumped side by side
    within ``timeout``; ``processes``: its (table text, [(host pid, ppid, command)]) where the runtime lists them
    itself (a host process tree), else ``docker top``'s. Raises DockerError when the container cannot be listed."""
    deadline = time.monotonic() + timeout
    try:
        pyspy = find_pyspy()
    except UserError as err:
        pyspy, missing = None, str(err)
    docker_top, processes = processes or _container_processes(container, timeout)
    taken_at = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(_PARALLEL_DUMPS, len(processes)))) as pool:
        dumps = [pool.submit(_dump, pyspy, pid, deadline) if pyspy else None for pid, _, _ in processes]
        entries = []
        for (pid, ppid, command), dump in zip(processes, dumps):
            threads, error = dump.result() if dump else (None, missing)
            process_rank, local_rank = _environ_ranks(pid)
            entries.append(
                {
                    "pid": pid,
                    "ppid": ppid,
                    "command": command,
                    "rank": process_rank,
                    "local_rank": local_rank,
                    "python": threads is not None,
                    "error": error,
                    "threads": threads or [],
                }
            )
    stacks = {
        "node": node,
        "rank": rank,
        "container": container,
        "why": why,
        "taken_at": taken_at,
        "processes": entries,
        "docker_top": docker_top,
        "log_tail": _log_tail(log_path, log_lines),
    }
    return mask_stacks(stacks, list(secret_values))


def mask_stacks(value, secret_values: Sequence[str]):
    """``value`` (stacks, or any part of them) with every string in it masked: a command line, a source line or a
    log line may hold a secret."""
    if isinstance(value, str):
        return mask_secrets(value, secret_values)
    if isinstance(value, dict):
        return {key: mask_stacks(item, secret_values) for key, item in value.items()}
    if isinstance(value, list):
        return [mask_stacks(item, secret_values) for item in value]
    return value


def format_stacks(stacks: Dict[str, object]) -> str:
    """stacks.txt: each process with its rank and command, then each thread's frames, innermost first."""
    taken = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(stacks.get("taken_at") or 0)))
    out = [
        f"{stacks.get('node')} (rank {stacks.get('rank')}): {stacks.get('container')}, {stacks.get('why')}, {taken}",
        "",
    ]
    for process in stacks.get("processes") or []:
        rank = "" if process.get("rank") is None else f"rank {process['rank']}, "
        out.append(f"== {rank}pid {process.get('pid')}: {process.get('command')}")
        if process.get("error"):
            out.append(f"   ({process['error']})")
        for thread in process.get("threads") or []:
            state = {True: " (idle)", False: " (active)"}.get(thread.get("idle"), "")
            out.append(f"   Thread {thread.get('name')}{state}")
            for frame in thread.get("frames") or []:
                out.append(f"      {frame.get('function')} ({frame.get('file')}:{frame.get('line')})")
                if frame.get("source"):
                    out.append(f"          {frame['source']}")
        out.append("")
    out += ["== docker top", str(stacks.get("docker_top") or ""), ""]
    out += ["== the container's last log lines", *(stacks.get("log_tail") or [])]
    return "\n".join(out) + "\n"


def write_stacks(node_dir: str, stacks: Dict[str, object], name: str = "stacks") -> Tuple[str, str]:
    """``<name>.txt`` and ``<name>.json`` in the node dir (``stacks`` as `take_container_stacks` masked them)."""
    text, data = (os.path.join(node_dir, name + os.path.splitext(file)[1]) for file in (STACKS_TEXT, STACKS_JSON))
    write_file_atomically(text, format_stacks(stacks).encode("utf-8"))
    write_file_atomically(data, (json.dumps(stacks, indent=1) + "\n").encode("utf-8"))
    return text, data


# ------------------------------------------------------------------------------ on demand: `slurm-multi stacks JOB`


def job_containers(job_id: str) -> List[Tuple[str, int]]:
    """(name, rank) of the job's containers on this node's daemon, by their labels (docs/contracts.md)."""
    listed = run_docker(
        [
            "ps",
            "--filter",
            f"label={LABEL_PREFIX}.job={job_id}",
            "--format",
            '{{.Names}}\t{{.Label "' + LABEL_PREFIX + '.rank"}}',
        ],
        timeout=30,
    ).stdout
    containers = []
    for line in listed.splitlines():
        name, _, rank = line.partition("\t")
        if name:
            containers.append((name, int(rank) if rank.isdigit() else -1))
    return sorted(containers, key=lambda container: container[1])


def container_secret_values(container: str) -> List[str]:
    """The values of the container's MAD_SECRETS_* variables (its env file gave them), to mask in its stacks."""
    listed = run_docker(["inspect", "--type", "container", "--format", "{{json .Config.Env}}", container], timeout=30)
    try:
        variables = json.loads(listed.stdout) or []
    except ValueError:
        return []
    return [value for name, _, value in (entry.partition("=") for entry in variables) if is_secret_name(name) and value]


def stacks_on_demand(job_id: str, attempt_dir: str, node: str, stamp: str) -> Dict[str, object]:
    """Every container of the job on this node: its stacks written into the node's dir as ``stacks-<stamp>.txt`` and
    ``.json`` (``stamp`` the same on every node of one call); {"node", "files"} or {"node", "error"}."""
    node_dir = os.path.join(job_layout.nodes_dir(attempt_dir), node)
    # A rank that is a host process tree (a daemonless runtime) names itself beside its log; no daemon is asked.
    rank_process = process_tree.running_rank(node_dir)
    if rank_process is not None:
        return _process_tree_stacks_on_demand(rank_process, node_dir, node, stamp)
    containers = job_containers(job_id)
    if not containers:
        return {
            "node": node,
            "error": f"no container of job {job_id} runs on {node}: its run has not started or "
            "has ended (`slurm-multi logs` shows where it is)",
        }
    files = []
    for container, rank in containers:
        stacks = take_container_stacks(
            container,
            rank,
            node,
            "on demand",
            secret_values=container_secret_values(container),
            log_path=os.path.join(node_dir, job_layout.RUN_LOG),
        )
        suffix = "" if len(containers) == 1 else f"-r{rank}"
        files.append(write_stacks(node_dir, stacks, name=f"stacks-{stamp}{suffix}")[0])
    return {"node": node, "files": files}


def process_secret_values(pid: int) -> List[str]:
    """The values of the process's MAD_SECRETS_* variables (its private env file gave them), to mask in its stacks."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return []
    return [value for name, _, value in (entry.partition("=") for entry in entries) if is_secret_name(name) and value]


def _process_tree_stacks_on_demand(rank_process: Dict[str, object], node_dir: str, node: str, stamp: str):
    pid = int(rank_process["pid"])
    container = str(rank_process.get("container") or f"pid {pid}")
    stacks = take_container_stacks(
        container,
        int(rank_process.get("rank") or 0),
        node,
        "on demand",
        secret_values=process_secret_values(pid)
        + [value for child in process_tree.tree_pids(pid) if child != pid for value in process_secret_values(child)],
        log_path=os.path.join(node_dir, job_layout.RUN_LOG),
        processes=process_tree.listing(process_tree.tree_pids(pid, os.getpgid(pid))),
    )
    return {"node": node, "files": [write_stacks(node_dir, stacks, name=f"stacks-{stamp}")[0]]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The node side of `slurm-multi stacks`: one JSON line saying what this node wrote."""
    parser = argparse.ArgumentParser(description="Take the stacks of a running job's containers on this node.")
    parser.add_argument("--job", required=True)
    parser.add_argument("--attempt-dir", required=True)
    parser.add_argument("--stamp", required=True, help="the files' UTC time, the same on every node")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    try:
        result = stacks_on_demand(job_layout.validate_job_id(args.job), args.attempt_dir, node, args.stamp)
    except (DockerError, OSError, UserError) as err:
        result = {"node": node, "error": str(err)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
