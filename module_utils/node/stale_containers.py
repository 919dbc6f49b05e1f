"""Which of this user's model containers on a node are stale, and removing them (the preparation stage's cleanup).
A container is removed only when its owner, named by its labels, is known to be gone (docs/contracts.md)."""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout

LABEL_PREFIX = "slurm-multi"
JOB_LABEL = f"{LABEL_PREFIX}.job"
USER_LABEL = f"{LABEL_PREFIX}.user"
UID_LABEL = f"{LABEL_PREFIX}.uid"
SLURM_JOB_LABEL = f"{LABEL_PREFIX}.slurm_job"
ATTEMPT_LABEL = f"{LABEL_PREFIX}.attempt"
PID_LABEL = f"{LABEL_PREFIX}.pid"
PID_START_LABEL = f"{LABEL_PREFIX}.pid_start"
BOOT_ID_LABEL = f"{LABEL_PREFIX}.boot_id"
PID_NS_LABEL = f"{LABEL_PREFIX}.pid_ns"
_LISTED_LABELS = (
    JOB_LABEL,
    USER_LABEL,
    UID_LABEL,
    SLURM_JOB_LABEL,
    ATTEMPT_LABEL,
    PID_LABEL,
    PID_START_LABEL,
    BOOT_ID_LABEL,
    PID_NS_LABEL,
)

# squeue's states of a job whose processes are gone. COMPLETING is not one: its run module may still be stopping
# the container inside KillWait. GONE is ours: SLURM no longer knows the job (purged after MinJobAge).
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "SPECIAL_EXIT",
        "REVOKED",
        "GONE",
    }
)
GONE = "GONE"
SQUEUE_TIMEOUT = 30.0

_INVALID_JOB_ID = "Invalid job id specified"


def boot_id() -> str:
    """This boot's random ID (changes at every boot); "" where the kernel does not offer it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]``); "" where /proc does not show it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22); None when it is gone (a
    zombie too: it runs nothing and waits only to be reaped)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name in (...) may hold spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def slurm_attempt(environ: Mapping[str, str]) -> Tuple[str, Optional[int]]:
    """(SLURM_JOB_ID, its attempt from SLURM_RESTART_COUNT, 0 when unset) of a process; ("", None) outside SLURM."""
    slurm_job = str(environ.get("SLURM_JOB_ID", "")).strip()
    if not slurm_job:
        return "", None
    restarts = str(environ.get("SLURM_RESTART_COUNT", "")).strip()
    return slurm_job, int(restarts) if restarts.isdigit() else 0


def owner_labels(environ: Mapping[str, str], pid: Optional[int] = None) -> Dict[str, str]:
    """The labels naming the process that starts a container now (``pid``, default this one) and its job."""
    pid = os.getpid() if pid is None else pid
    slurm_job, attempt = slurm_attempt(environ)
    return {
        UID_LABEL: str(os.geteuid()),
        SLURM_JOB_LABEL: slurm_job,
        ATTEMPT_LABEL: "" if attempt is None else str(attempt),
        PID_LABEL: str(pid),
        PID_START_LABEL: process_start(pid) or "",
        BOOT_ID_LABEL: boot_id(),
        PID_NS_LABEL: pid_namespace(),
    }


@dataclass(frozen=True)
class NodeView:
    """What the judging process knows about itself: its uid, boot, PID namespace, and its own SLURM job's attempt."""

    uid: int
    boot_id: str
    pid_namespace: str
    slurm_job: str = ""
    attempt: Optional[int] = None


@dataclass(frozen=True)
class Verdict:
    """One container's verdict: remove it (stale) or keep it, and why."""

    name: str
    stale: bool
    reason: str
    ours: bool = True  # False: another user's container; never touched and not reported
    worth_a_warning: bool = False  # kept for a reason its owner should hear about


def _int_label(labels: Mapping[str, str], key: str) -> Optional[int]:
    value = (labels.get(key) or "").strip()
    return int(value) if value.isdigit() else None


def judge_container(
    name: str,
    labels: Mapping[str, str],
    node: NodeView,
    user: str,
    job_states: Mapping[str, str],
    live_processes: Mapping[int, str],
) -> Verdict:
    """Whether ``name`` (with ``labels``) is a stale container of ``node.uid`` that may be removed. ``job_states``:
    squeue's state (or ``GONE``) by job ID; ``live_processes``: start time of each labelled pid alive here."""
    uid = _int_label(labels, UID_LABEL)
    if uid is None:
        if UID_LABEL in labels and labels[UID_LABEL].strip():
            return Verdict(name, False, f"its {UID_LABEL} label {labels[UID_LABEL]!r} is not a uid", ours=False)
        ours = labels.get(USER_LABEL) == user
        return Verdict(
            name,
            False,
            "it predates the owner labels (slurm-multi < 0.2), so its run cannot be "
            f"judged: remove it by hand (docker rm -f {name}) once its job has ended",
            ours=ours,
            worth_a_warning=True,
        )
    if uid != node.uid:
        return Verdict(name, False, f"it belongs to uid {uid}", ours=False)

    slurm_job = (labels.get(SLURM_JOB_LABEL) or "").strip()
    if slurm_job:
        if not job_layout.is_slurm_job_number(slurm_job):
            return Verdict(name, False, f"its SLURM job ID {slurm_job!r} is not one SLURM could be asked about")
        attempt = _int_label(labels, ATTEMPT_LABEL)
        if slurm_job == node.slurm_job and None not in (attempt, node.attempt) and attempt < node.attempt:
            return Verdict(
                name,
                True,
                f"it is from attempt {attempt} of this SLURM job {slurm_job}, now at attempt {node.attempt} (requeued)",
            )
        state = job_states.get(slurm_job)
        if state is None:
            return Verdict(name, False, f"the state of SLURM job {slurm_job} is unknown", worth_a_warning=True)
        if state in ENDED_STATES:
            detail = "SLURM no longer knows it" if state == GONE else state
            return Verdict(name, True, f"its SLURM job {slurm_job} has ended ({detail})")
        return Verdict(name, False, f"its SLURM job {slurm_job} is {state}")

    # A run outside SLURM: its owning process (the run module) waits for the container and removes it.
    label_boot = (labels.get(BOOT_ID_LABEL) or "").strip()
    pid = _int_label(labels, PID_LABEL)
    if not label_boot or not node.boot_id or pid is None:
        return Verdict(name, False, "its owning process cannot be identified (no boot ID or pid)")
    if label_boot != node.boot_id:
        return Verdict(name, True, f"its owning process (pid {pid}) ran before this node's last boot")
    if (labels.get(PID_NS_LABEL) or "") != node.pid_namespace or not node.pid_namespace:
        return Verdict(name, False, f"its owning process (pid {pid}) ran in another PID namespace")
    started = live_processes.get(pid)
    if started is None:
        return Verdict(name, True, f"its owning process (pid {pid}) is gone")
    if (labels.get(PID_START_LABEL) or "") not in ("", started):
        return Verdict(name, True, f"its owning process (pid {pid}) is gone (the pid now names another process)")
    return Verdict(name, False, f"its owning process (pid {pid}) is alive")


def parse_squeue_states(asked: Sequence[str], returncode: int, stdout: str, stderr: str) -> Dict[str, str]:
    """squeue's answer (``-o '%A %T'``) as job ID -> state: a job it no longer knows is GONE; any other failure answers
    for no job (unknown, never ended)."""
    if returncode != 0:
        if len(asked) == 1 and _INVALID_JOB_ID in stderr:
            return {asked[0]: GONE}
        return {}
    states = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].upper()
    return {job: states.get(job, GONE) for job in asked}


def slurm_job_states(job_ids: Iterable[str], timeout: float = SQUEUE_TIMEOUT) -> Tuple[Dict[str, str], Optional[str]]:
    """Ask SLURM about exactly these job IDs: (job ID -> state for those it answered, why it could not or None)."""
    asked = sorted({job for job in job_ids if job_layout.is_slurm_job_number(job)}, key=int)
    if not asked:
        return {}, None
    argv = ["squeue", "-h", "-t", "all", "-j", ",".join(asked), "-o", "%A %T"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {}, f"`{' '.join(argv)}` could not run: {err}"
    states = parse_squeue_states(asked, proc.returncode, proc.stdout, proc.stderr)
    problem = None
    if not states:
        problem = f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return states, problem


@dataclass
class Cleanup:
    """What the cleanup did on one node: the containers removed and the ones of this user kept, with reasons."""

    removed: List[Verdict]
    kept: List[Verdict]
    warnings: List[str]

    def as_result(self) -> Dict[str, object]:
        """The module result's fields (the stale_containers module's RETURN, node_facts' stale_containers)."""
        return {
            "removed": [verdict.name for verdict in self.removed],
            "reasons": {verdict.name: verdict.reason for verdict in self.removed},
            "kept": [{"name": verdict.name, "reason": verdict.reason} for verdict in self.kept],
        }


def _listed_containers() -> List[Tuple[str, str, Dict[str, str]]]:
    """(ID, name, labels) of every container with a slurm-multi job label on this node's daemon."""
    listed = docker_api.labelled_containers(JOB_LABEL)
    if listed is not None:
        return [
            (container_id, name, {key: labels[key] for key in _LISTED_LABELS if labels.get(key, "") != ""})
            for container_id, name, labels in listed
        ]
    fields = "\t".join(f'{{{{.Label "{label}"}}}}' for label in _LISTED_LABELS)
    listed = run_docker(
        ["ps", "--all", "--no-trunc", "--filter", f"label={JOB_LABEL}", "--format", "{{.ID}}\t{{.Names}}\t" + fields],
        timeout=60,
    )
    containers = []
    for line in listed.stdout.splitlines():
        values = line.split("\t")
        if len(values) == len(_LISTED_LABELS) + 2:
            labels = dict(zip(_LISTED_LABELS, values[2:]))
            containers.append((values[0], values[1], {key: value for key, value in labels.items() if value != ""}))
    return containers


def remove_stale_containers(user: str, check_mode: bool = False) -> Cleanup:
    """Remove this uid's containers whose owner is known to be gone (see the module doc); report the others."""
    node = NodeView(os.geteuid(), boot_id(), pid_namespace(), *slurm_attempt(os.environ))
    containers = _listed_containers()
    ours = [labels for _, _, labels in containers if _int_label(labels, UID_LABEL) == node.uid]
    job_states, squeue_problem = slurm_job_states(labels.get(SLURM_JOB_LABEL, "") for labels in ours)
    live = {}
    for labels in ours:
        pid = _int_label(labels, PID_LABEL)
        if pid is not None and not labels.get(SLURM_JOB_LABEL):
            started = process_start(pid)
            if started is not None:
                live[pid] = started
    # Removal goes by container ID: a name may be taken again by a new run once the old container is gone.
    ids = {}
    verdicts = []
    for container_id, name, labels in containers:
        verdict = judge_container(name, labels, node, user, job_states, live)
        ids[verdict.name] = container_id
        verdicts.append(verdict)
    removed = [v for v in verdicts if v.ours and v.stale]
    kept = [v for v in verdicts if v.ours and not v.stale]
    warnings = [f"kept {v.name}: {v.reason}" for v in kept if v.worth_a_warning]
    if squeue_problem and warnings:
        warnings.append(f"SLURM could not be asked about those jobs: {squeue_problem}")
    if not check_mode:
        for verdict in removed:
            remove_container(ids[verdict.name], timeout=60)
    return Cleanup(removed, kept, warnings)


def remove_container(container: str, timeout: float = 30.0) -> None:
    """``docker rm -f`` a container by name or ID, through the API where it answers; one already gone is no error."""
    if docker_api.remove_container(container, timeout=timeout) is not None:
        return
    try:
        run_docker(["rm", "-f", container], timeout=timeout)
    except DockerError as err:
        if "no such container" not in str(err).lower():
            raise


def current_user() -> str:
    """The name of the user this process runs as (the owner of its containers)."""
    return pwd.getpwuid(os.geteuid()).pw_name
