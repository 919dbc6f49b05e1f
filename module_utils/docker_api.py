"""The Docker Engine API over the daemon's unix socket, for the small calls a node makes on every run (a CLI call
starts a Go process on the job's critical path). Each function returns ``None`` whenever the API cannot stand in for
the CLI, and the caller runs the CLI, so every error a user sees is still the CLI's own."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import quote, urlencode

DEFAULT_SOCKET = "/var/run/docker.sock"


def engine_socket(host: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The unix socket the docker CLI would talk to (``host``, else DOCKER_HOST, else the default socket), or None
    when the CLI would go elsewhere or decide by its config (a context)."""
    environ = os.environ if environ is None else environ
    target = host or environ.get("DOCKER_HOST")
    if target:
        return target[len("unix://") :] if target.startswith("unix://") else None
    if environ.get("DOCKER_CONTEXT"):
        return None
    config_dir = environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    try:
        with open(os.path.join(config_dir, "config.json")) as handle:
            if json.load(handle).get("currentContext") not in (None, "", "default"):
                return None
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError):
        return None  # a config the CLI reads its own way
    return DEFAULT_SOCKET


def _exchange(
    method: str,
    target: str,
    body: Optional[Mapping[str, Any]] = None,
    host: Optional[str] = None,
    timeout: float = 30.0,
) -> Optional[Tuple[int, bytes]]:
    """(HTTP status, the raw body) of one request within ``timeout``, or None when the daemon could not be asked so
    (HTTP/1.0: the daemon sends the whole body and closes, so no HTTP library is needed)."""
    socket_path = engine_socket(host)
    if socket_path is None:
        return None
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {target} HTTP/1.0\r\nHost: docker\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.connect(socket_path)
            connection.sendall(head.encode() + b"\r\n" + payload)
            chunks = []
            while True:
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = connection.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        answer_head, _, answer_body = b"".join(chunks).partition(b"\r\n\r\n")
        return int(answer_head.split(b" ", 2)[1]), answer_body
    except (OSError, ValueError, IndexError):
        return None


def engine_call(
    method: str,
    path: str,
    query: Optional[Mapping[str, str]] = None,
    host: Optional[str] = None,
    timeout: float = 30.0,
    body: Optional[Mapping[str, Any]] = None,
) -> Optional[Tuple[int, Any]]:
    """(HTTP status, the JSON body or None) of one API call, or None when the daemon could not be asked this way."""
    answer = _exchange(method, path + ("?" + urlencode(query) if query else ""), body, host, timeout)
    if answer is None:
        return None
    status, raw = answer
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return None


def demultiplexed(stream: bytes) -> bytes:
    """The output of a container's stream without a TTY (frames of an 8-byte header and the bytes), stdout and
    stderr in the order they came; the stream as it is when not framed so (a TTY's, or the daemon's own error)."""
    output, at = [], 0
    while at < len(stream):
        header = stream[at : at + 8]
        if len(header) < 8 or header[0] not in (0, 1, 2) or header[1:4] != b"\0\0\0":
            return stream
        size = int.from_bytes(header[4:], "big")
        output.append(stream[at + 8 : at + 8 + size])
        at += 8 + size
    return b"".join(output)


def _name(reference: str) -> str:
    return quote(reference, safe="/:@")


def _answer(path: str, kind: type, query: Optional[Mapping[str, str]] = None, timeout: float = 30.0):
    """The body of a GET that the daemon answered 200 with a JSON ``kind``; None for anything else."""
    answer = engine_call("GET", path, query, timeout=timeout)
    return answer[1] if answer is not None and answer[0] == 200 and isinstance(answer[1], kind) else None


def image_inspection(reference: str, host: Optional[str] = None, timeout: float = 30.0) -> Optional[dict]:
    """`docker image inspect REFERENCE`'s object ({} when there is no such image), or None."""
    answer = engine_call("GET", f"/images/{_name(reference)}/json", host=host, timeout=timeout)
    if answer is None:
        return None
    status, body = answer
    if status == 404:
        return {}
    return body if status == 200 and isinstance(body, dict) and body.get("Id") else None


def container_state(name: str, timeout: float = 30.0) -> Optional[Dict[str, Any]]:
    """The container's `State` (Running, ExitCode, ...), or None (no such container included)."""
    state = (container_inspection(name, timeout) or {}).get("State")
    return state if isinstance(state, dict) else None


def container_processes(name: str, timeout: float = 30.0) -> Optional[List[Tuple[str, str]]]:
    """(host PID, command line) of each process in the running container (`docker top NAME -eo pid,args`), or None."""
    top = _answer(f"/containers/{_name(name)}/top", dict, {"ps_args": "-eo pid,args"}, timeout)
    if top is None:
        return None
    try:
        return [(str(pid), str(args)) for pid, args in top["Processes"] or []]
    except (KeyError, TypeError, ValueError):
        return None


def remove_container(name: str, timeout: float = 30.0) -> Optional[bool]:
    """`docker rm -f NAME`: True once removed, False when there was no such container, else None."""
    answer = engine_call("DELETE", f"/containers/{_name(name)}", {"force": "1"}, timeout=timeout)
    if answer is None:
        return None
    return {204: True, 404: False}.get(answer[0])


def server_info(field: str, timeout: float = 30.0) -> Optional[Any]:
    """One field of `docker info`, or None."""
    info = _answer("/info", dict, timeout=timeout)
    return None if info is None else info.get(field)


def server_version(timeout: float = 30.0) -> Optional[str]:
    """The daemon's version (`docker version`'s Server.Version), or None."""
    version = (_answer("/version", dict, timeout=timeout) or {}).get("Version")
    return version if isinstance(version, str) and version else None


def labelled_containers(label: str, timeout: float = 60.0) -> Optional[List[Tuple[str, str, Dict[str, str]]]]:
    """(ID, name, labels) of every container, running or not, that carries ``label``, or None."""
    listing = _answer("/containers/json", list, {"all": "1", "filters": json.dumps({"label": [label]})}, timeout)
    if listing is None:
        return None
    containers = []
    for listed in listing:
        try:
            name = listed["Names"][0].lstrip("/")
            containers.append((listed["Id"], name, dict(listed.get("Labels") or {})))
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return containers


def stop_container(name: str, grace: int) -> Optional[bool]:
    """`docker stop -t GRACE NAME`: True once stopped, False when it had already stopped, else None. From this
    process, so a stop that SLURM's SIGTERM reaches midway still waits out the grace, where a CLI child would die."""
    answer = engine_call("POST", f"/containers/{_name(name)}/stop", {"t": str(grace)}, timeout=grace + 30)
    if answer is None:
        return None
    return {204: True, 304: False}.get(answer[0])


def exec_output(name: str, command: Sequence[str], timeout: float = 30.0) -> Optional[Tuple[int, str]]:
    """(exit code, stdout and stderr) of `docker exec NAME COMMAND...` within ``timeout``, or None."""
    deadline = time.monotonic() + timeout
    created = engine_call(
        "POST",
        f"/containers/{_name(name)}/exec",
        body={"Cmd": list(command), "AttachStdout": True, "AttachStderr": True},
        timeout=timeout,
    )
    if created is None or created[0] != 201 or not isinstance(created[1], dict) or not created[1].get("Id"):
        return None
    exec_id = quote(str(created[1]["Id"]), safe="")
    started = _exchange(
        "POST", f"/exec/{exec_id}/start", {"Detach": False, "Tty": False}, timeout=max(deadline - time.monotonic(), 0)
    )
    if started is None or started[0] != 200:
        return None
    output = demultiplexed(started[1])
    # The stream closes as the process ends; its exit code is recorded a moment later.
    while True:
        inspected = _answer(f"/exec/{exec_id}/json", dict, timeout=max(deadline - time.monotonic(), 0.001))
        exit_code = (inspected or {}).get("ExitCode")
        if isinstance(exit_code, int) and not (inspected or {}).get("Running"):
            return exit_code, output.decode("utf-8", errors="replace")
        if inspected is None or time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def container_log_tail(name: str, lines: int, timeout: float = 30.0) -> Optional[str]:
    """`docker logs --tail LINES NAME`'s stdout and stderr, or None."""
    query = urlencode({"stdout": 1, "stderr": 1, "tail": lines})
    answer = _exchange("GET", f"/containers/{_name(name)}/logs?{query}", timeout=timeout)
    if answer is None or answer[0] != 200:
        return None
    return demultiplexed(answer[1]).decode("utf-8", errors="replace")


def container_inspection(name: str, timeout: float = 30.0) -> Optional[Dict[str, Any]]:
    """`docker inspect --type container NAME`'s object, or None (no such container included)."""
    return _answer(f"/containers/{_name(name)}/json", dict, timeout=timeout)
