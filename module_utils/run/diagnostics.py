"""A bounded, non-fatal evidence snapshot of a model container that failed, hung or was cancelled, within SLURM's
KillWait, through the daemon's API where it can (SIGTERM would kill a CLI child midway); secrets masked."""

from __future__ import annotations

import datetime
import json
import time
from typing import Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api, safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets

DEFAULT_LOG_DIRS = ("/run_logs",)
DEFAULT_BUDGET = 15.0
DEFAULT_COMMAND_TIMEOUT = 5.0
DEFAULT_OUTPUT_CAP = 32 * 1024
DEFAULT_TAIL_LINES = 200

# Busybox, Debian/Ubuntu and RHEL-like images each answer a different one of these: the first that works wins.
PROCESS_TABLE_COMMANDS = (["ps", "auxww"], ["ps", "-ef"], ["ps"])
LISTENING_SOCKET_COMMANDS = (
    ["ss", "-ltnp"],
    ["netstat", "-ltnp"],
    ["netstat", "-ltn"],
    ["lsof", "-nP", "-iTCP", "-sTCP:LISTEN"],
)

# The log dir and the tail length travel as positional arguments ($1, $2): nothing of ours is spliced into the
# script text. At most 20 files, so one huge dir cannot eat the budget.
_LOG_TAIL_SCRIPT = (
    'find "$1" -maxdepth 3 -type f -name "*.log" 2>/dev/null | head -n 20 | '
    'while IFS= read -r f; do echo "==> $f <=="; tail -n "$2" "$f"; done'
)

_STATE_FORMAT = '{"State": {{json .State}}, "Env": {{json .Config.Env}}, "Image": {{json .Config.Image}}}'
_STATE_FIELDS = ("Status", "Running", "ExitCode", "OOMKilled", "Error", "StartedAt", "FinishedAt")


def _cap(text: str, limit: int, keep: str) -> str:
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    if keep == "tail":
        return f"[... {cut} characters cut ...]\n" + text[-limit:]
    return text[:limit] + f"\n[... {cut} characters cut ...]"


def _text(data) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


class _Snapshot:
    """Runs the snapshot's docker commands under one budget and gathers the sections."""

    def __init__(self, container: str, budget: float, command_timeout: float, output_cap: int):
        self.container = container
        self.deadline = time.monotonic() + budget
        self.command_timeout = command_timeout
        self.output_cap = output_cap
        self.sections = []  # type: List[Tuple[str, str]]

    def docker(self, args: Sequence[str]) -> Tuple[bool, str]:
        """(succeeded, output or the error) of one docker command; never raises."""
        timeout = min(self.command_timeout, self.deadline - time.monotonic())
        if timeout <= 0:
            return False, "skipped: the diagnostics time budget is spent"
        try:
            answered = self._through_the_api(args, timeout)
            if answered is not None:
                return answered
            completed = run_docker(list(args), timeout=timeout, check=False)
        except DockerError as err:
            return False, f"failed: {err}"
        except Exception as err:  # noqa: BLE001 - a snapshot records its own failures, it never raises them
            return False, f"failed: {type(err).__name__}: {err}"
        output = _text(completed.stdout) + _text(completed.stderr)
        if completed.returncode != 0:
            return False, f"exit code {completed.returncode}: {output.strip()}"
        return True, output

    def _through_the_api(self, args: Sequence[str], timeout: float) -> Optional[Tuple[bool, str]]:
        """The snapshot's three kinds of command (inspect, exec, logs) answered by the API; None: run the CLI."""
        if args[0] == "exec":
            ran = docker_api.exec_output(args[1], args[2:], timeout)
            if ran is None:
                return None
            return (True, ran[1]) if ran[0] == 0 else (False, f"exit code {ran[0]}: {ran[1].strip()}")
        if args[0] == "logs":
            tail = docker_api.container_log_tail(args[-1], int(args[2]), timeout)
            return None if tail is None else (True, tail)
        inspected = docker_api.container_inspection(args[-1], timeout)
        if inspected is None:
            return None
        config = inspected.get("Config") or {}
        return True, json.dumps(
            {"State": inspected.get("State"), "Env": config.get("Env"), "Image": config.get("Image")}
        )

    def first_working(self, title: str, commands: Sequence[Sequence[str]], keep: str = "head") -> None:
        """Record the output of the first command that works inside the container, or why none did."""
        failures = []
        for command in commands:
            ok, output = self.docker(["exec", self.container, *command])
            if ok:
                self.add(f"{title} ({' '.join(command)})", output, keep)
                return
            # The first line says why (not found, bad option); the usage text that follows is noise.
            failures.append(f"$ {' '.join(command)}: {output.strip().splitlines()[0][:300] if output.strip() else ''}")
        self.add(title, "\n".join(failures), keep="tail")

    def add(self, title: str, text: str, keep: str = "head") -> None:
        self.sections.append((title, _cap(text.rstrip("\n"), self.output_cap, keep)))


def _state_report(raw: str) -> Tuple[Optional[bool], str]:
    """(running?, text) from the inspect output: the state fields and the environment variable names only."""
    try:
        inspected = json.loads(raw)
    except ValueError:
        return None, f"unreadable docker inspect output: {raw[:500]}"
    state = inspected.get("State") or {}
    lines = [f"{field}: {state.get(field)}" for field in _STATE_FIELDS]
    lines.append(f"Image: {inspected.get('Image')}")
    names = sorted(entry.split("=", 1)[0] for entry in inspected.get("Env") or [])
    lines.append(f"Environment variable names (values omitted): {' '.join(names)}")
    return bool(state.get("Running")), "\n".join(lines)


def collect_container_diagnostics(
    container: str,
    log_dirs: Sequence[str] = DEFAULT_LOG_DIRS,
    secret_values: Sequence[str] = (),
    budget: float = DEFAULT_BUDGET,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    output_cap: int = DEFAULT_OUTPUT_CAP,
    tail_lines: int = DEFAULT_TAIL_LINES,
    reason: str = "",
) -> str:
    """The diagnostics text of one container; never raises for Docker's failures."""
    snapshot = _Snapshot(container, budget, command_timeout, output_cap)
    ok, output = snapshot.docker(["inspect", "--type", "container", "--format", _STATE_FORMAT, container])
    running = None  # type: Optional[bool]
    if ok:
        running, output = _state_report(output)
    snapshot.add("docker inspect state", output)

    if running:
        snapshot.first_working("process table", PROCESS_TABLE_COMMANDS)
        snapshot.first_working("listening sockets", LISTENING_SOCKET_COMMANDS)
        for log_dir in log_dirs:
            ok, output = snapshot.docker(
                ["exec", container, "sh", "-c", _LOG_TAIL_SCRIPT, "sh", log_dir, str(tail_lines)]
            )
            snapshot.add(f"log files under {log_dir} (last {tail_lines} lines each)", output or "(none)", "tail")

    ok, output = snapshot.docker(["logs", "--tail", str(tail_lines), container])
    snapshot.add(f"container log (last {tail_lines} lines)", output, "tail")

    taken_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = [f"# slurm-multi diagnostics of container {container}", f"# taken at {taken_at}"]
    if reason:
        header.append(f"# reason: {reason}")
    body = [f"\n== {title} ==\n{text}" for title, text in snapshot.sections]
    return mask_secrets("\n".join(header) + "\n" + "\n".join(body) + "\n", secret_values)


def write_diagnostics(path: str, text: str) -> str:
    """Write a snapshot atomically (safe_files.write_file_atomically: a reader never sees half of one); OSError."""
    safe_files.write_file_atomically(path, text.encode("utf-8"), 0o644)
    return path


def write_container_diagnostics(path: str, container: str, **options) -> str:
    """Collect the diagnostics of ``container`` (options of `collect_container_diagnostics`) into ``path``; only
    writing the file can raise (OSError)."""
    return write_diagnostics(path, collect_container_diagnostics(container, **options))
