"""Stop a running pipeline so that every node's run module records its node and removes its container.

    python -m slurm_multi.pipeline_stop PIPELINE_PID [--drain-seconds N]    # the job script's stop_pipeline

srun answers a SIGTERM of its own by SIGKILLing its step at once, and Ansible's workers pass a TERM on to everything
in their session (other nodes' srun clients, this node's run module): a TERM to ansible-playbook first would kill
the run module on every other node half-way, leaving no status.json and its container running. Hence, each wait
bounded (SLURM SIGKILLs the job KillWait after the time limit's TERM anyway):

1. TERM the job's steps through SLURM (`scancel --signal=TERM` spares the batch script): every other node's run
   module stops its container and writes its status.json, and its srun client returns by itself.
2. Wait until none of the pipeline's srun clients is left, then give the pipeline a while to end by itself (the
   cancelled run modules' ABORT marker stops this node's run module too).
3. Else TERM the pipeline's process group, which reaches whatever this node runs.
4. Wait until every process of the pipeline's sessions has ended, so that postprocessing reads every status.json.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

STEPS_WAIT_SECONDS = 40
OWN_END_SECONDS = 20
DRAIN_SECONDS = 60
POLL_SECONDS = 0.25


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every live process (no zombie) as {pid: (parent pid, session ID, command name)}, from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp session ...": the name may hold spaces and parentheses, so split at the last ")".
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":  # ended, not yet reaped by its parent (the job script, busy stopping it)
            table[int(entry.name)] = (int(fields[1]), int(fields[3]), name)
    return table


def descendants(root: int, table: dict[int, tuple[int, int, str]]) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root] if root in table else []
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def _wait(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _srun_clients(pipeline: int) -> list[int]:
    table = _processes()
    return [pid for pid in descendants(pipeline, table) if table[pid][2] == "srun"]


def _sessions(pipeline: int) -> set[int]:
    table = _processes()
    return {table[pid][1] for pid in descendants(pipeline, table)} - {os.getsid(0)}


def stop_pipeline(
    pipeline: int, job_id: str | None, *, drain: float = DRAIN_SECONDS, say: Callable[[str], None] = print
) -> None:
    """Stop the pipeline whose process group leader is ``pipeline``, as the module docstring says."""
    sessions = _sessions(pipeline)
    ended = False
    if job_id:
        subprocess.run(["scancel", "--signal=TERM", job_id], check=False, capture_output=True, timeout=60)
        if not _wait(lambda: not _srun_clients(pipeline), STEPS_WAIT_SECONDS):
            say(
                f"slurm-multi: the job's steps still run {STEPS_WAIT_SECONDS:g} s after their TERM: ending them with "
                "the pipeline (a node whose run module they cut short has no status.json)"
            )
        ended = _wait(lambda: pipeline not in _processes(), OWN_END_SECONDS)
    sessions |= _sessions(pipeline)  # its workers of now, this node's run module in one of them
    if not ended:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(pipeline, signal.SIGTERM)
    if not _wait(lambda: not any(sid in sessions for _, sid, _ in _processes().values()), drain):
        say(f"slurm-multi: the pipeline's processes still run {drain:g} s after the stop: collecting without them")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_multi.pipeline_stop", description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", type=int, help="the pipeline's process group leader (the job script's setsid)")
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS)
    args = parser.parse_args(argv)
    # The time limit's TERM comes while this runs: it is for the pipeline, and stopping it is what this is doing.
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    stop_pipeline(args.pipeline, os.environ.get("SLURM_JOB_ID"), drain=args.drain_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
