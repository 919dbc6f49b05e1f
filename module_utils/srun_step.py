"""How the srun connection runs one Ansible task as a job step, and how it reads srun's failures.

Pure functions, so the rules (what the step may see, what counts as transient) are tested without a cluster.
"""

from __future__ import annotations

import re

# What a task on a node needs of the controller's environment. Everything else, secrets (MAD_SECRETS_*) and
# credentials first among them, stays on the controller.
STEP_ENV_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_*", "TERM", "TZ", "TMPDIR",
    "SLURM_*", "MASTER_ADDR", "MASTER_PORT", "MAD_DOCKER_BUILDS", "SLURM_MULTI_*",
)
NEVER_EXPORTED = ("MAD_SECRETS_*",)

# srun could not create or launch the step; nothing ran yet, so trying again is safe.
_TRANSIENT = re.compile(
    r"Socket timed out on send/recv|Unable to contact slurm controller|temporarily unable to accept job"
    r"|Zero Bytes were transmitted or received|Slurm backup controller in standby mode|Resource temporarily unavailable"
    r"|Job step creation temporarily disabled",
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
    """srun's argv for one task on one node of the job's allocation, sharing its resources with running steps."""
    return ["srun", f"--jobid={job_id}", "--overlap", "-N1", "-n1", "-w", node, "--quiet", "--mpi=none",
            "--export=ALL", "/bin/sh", "-c", command]


def is_transient_srun_error(stderr: str) -> bool:
    """True when srun failed before anything ran, for a reason that may pass (controller busy, timeouts)."""
    return bool(_TRANSIENT.search(stderr or ""))


def unreachable_reason(stderr: str) -> str | None:
    """srun's own words when the node cannot run steps (not in the allocation, dead); None otherwise.

    A task that ran and exited non-zero is not one: srun then only reports the exit code.
    """
    match = _UNREACHABLE.search(stderr or "")
    return match.group(1).strip() if match else None
