"""How the srun connection runs one Ansible task as a job step, and how it reads srun's failures. A task may be retried
only when it never ran: the step first prints `STEP_STARTED` on stderr (removed from what the task returns)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

# What a task on a node needs of the controller's environment. Everything else, secrets (MAD_SECRETS_*) and
# credentials first among them, stays on the controller.
STEP_ENV_ALLOWLIST = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TERM",
    "TZ",
    "TMPDIR",
    "SLURM_*",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MAD_DOCKER_BUILDS",
    "SLURM_MULTI_*",
)
NEVER_EXPORTED = ("MAD_SECRETS_*",)

STEP_STARTED = "slurm-multi: srun step started"
_STEP_STARTED_LINE = (STEP_STARTED + "\n").encode()
# While the task runs, the step says it is alive on stderr this often. srun itself learns nothing of a node that
# died (its address drops every packet) for a long while (docs/figures.md), and SLURM not before SlurmdTimeout:
# the srun connection takes a step silent for STEP_SILENT_AFTER seconds for a dead node.
STEP_HEARTBEAT = "slurm-multi: srun step alive"
_STEP_HEARTBEAT_LINE = (STEP_HEARTBEAT + "\n").encode()
HEARTBEAT_INTERVAL = 3
STEP_SILENT_AFTER = 15
# `sh -c SCRIPT ARG0 COMMAND`: the task's command travels as its own argument, never spliced into the script. The
# heartbeat reads no stdin (the module's own, pipelined) and ends with its step's shell, were it even killed.
_STARTER = (
    f'printf "%s\\n" "{STEP_STARTED}" >&2 || exit 1; step=$$; '
    # Its sleep holds none of the step's output open: the step ends when the task does, not a beat later.
    f'(while sleep {HEARTBEAT_INTERVAL} 2>/dev/null && kill -0 "$step" 2>/dev/null; '
    f'do printf "%s\\n" "{STEP_HEARTBEAT}" >&2; done) </dev/null >/dev/null & beat=$!; '
    '/bin/sh -c "$1"; rc=$?; kill "$beat" 2>/dev/null; exit "$rc"'
)
# srun's own messages. A task may print such lines too, but only after STEP_STARTED: a started step is never retried.
_SRUN_OWN_LINE = re.compile(r"^srun: (error|fatal): ")

# srun could not reach the controller or create the step, for a reason that may pass. Only srun's own lines of
# a step that never started are read against it.
_TRANSIENT = re.compile(
    r"Socket timed out on send/recv|Unable to contact slurm controller|temporarily unable to accept job"
    r"|Zero Bytes were transmitted or received|Slurm backup controller in standby mode|Resource temporarily unavailable"
    r"|Job step creation temporarily disabled|Connection reset by peer",
    re.IGNORECASE,
)
# The node is not (or no longer) part of the allocation, or its slurmd cannot be reached.
_UNREACHABLE = re.compile(
    r"(Requested node configuration is not available|Invalid node name specified"
    r"|Communication connection failure|Unable to confirm allocation|Job/step already completing or completed"
    r"|Application launch failed: [^\n]*|Task launch for [^\n]* failed[^\n]*|Node count specification invalid)",
    re.IGNORECASE,
)


def _matches(name: str, patterns) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def step_environment(environ, extra=()) -> dict:
    """The environment srun gets, and so the step: the allowlist plus `extra`, never MAD_SECRETS_*."""
    allowed = tuple(STEP_ENV_ALLOWLIST) + tuple(extra or ())
    return {k: v for k, v in environ.items() if _matches(k, allowed) and not _matches(k, NEVER_EXPORTED)}


def step_command(job_id: str, node: str, command: str) -> list:
    """srun's argv for one task on one node of the job's allocation, sharing its resources with running steps; the
    step prints `STEP_STARTED` on stderr before it runs ``command``."""
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "-N1",
        "-n1",
        "-w",
        node,
        "--quiet",
        "--mpi=none",
        "--export=ALL",
        "/bin/sh",
        "-c",
        _STARTER,
        "slurm-multi-step",
        command,
    ]


@dataclass
class StepResult:
    """What one srun call returned; ``stderr`` without the STEP_STARTED line, ``started`` when it was there."""

    returncode: int
    stdout: bytes
    stderr: bytes
    started: bool

    @property
    def srun_errors(self) -> List[str]:
        """srun's own error lines (``srun: error: ...``)."""
        text = self.stderr.decode(errors="replace")
        return [line for line in text.splitlines() if _SRUN_OWN_LINE.match(line)]


def read_step_result(returncode: int, stdout: bytes, stderr: bytes) -> StepResult:
    """The step's result, with our lines taken out of its stderr: the first STEP_STARTED (printed before the
    command) and every heartbeat (whole lines, wherever the task's own output put them)."""
    stdout, stderr = stdout or b"", stderr or b""
    started = _STEP_STARTED_LINE in stderr
    if started:
        stderr = stderr.replace(_STEP_STARTED_LINE, b"", 1).replace(_STEP_HEARTBEAT_LINE, b"")
    return StepResult(returncode, stdout, stderr, started)


def is_transient_srun_error(result: StepResult) -> bool:
    """True when srun failed before the step started (no marker, no output: the command never ran, so a retry is
    safe), for a reason that may pass."""
    if result.returncode == 0 or result.started or result.stdout:
        return False
    return any(_TRANSIENT.search(line) for line in result.srun_errors)


def unreachable_reason(result: StepResult) -> Optional[str]:
    """srun's own words (its ``srun: error:`` lines only) when the node cannot run steps (not in the allocation, dead);
    None otherwise, a task that ran and failed too."""
    if result.returncode == 0:
        return None
    for line in result.srun_errors:
        match = _UNREACHABLE.search(line)
        if match:
            return match.group(1).strip()
    return None
