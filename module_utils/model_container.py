"""Run one node's model container for a multi-node job, and decide that node's verdict.

One call per node, all nodes at once (`run_model_container`): the container starts detached
(``docker run -d --init``, named ``slurm-multi-<job>-r<rank>`` and labelled as docs/contracts.md says), its log is
followed into ``<results_dir>/<job>/attempt-<N>/nodes/<node>/run.log``, and the call waits until the container
exits, the model's timeout or the job's end (minus a margin) is reached, another rank fails, or a signal cancels
the run.

Inside the container
    The host's model dir is mounted at ``/myworkspace`` (the working dir), the way MAD lays out a run; the
    model's script runs from there as argv: ``sh <script> <args...>`` for a ``.sh`` file, else the file itself,
    with the card's args split by `shlex` and never passed through a shell or a template on our side. The
    multi-node environment is MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK and the GPU variables; the context's
    ``docker_env_vars`` and the job's secrets travel in a node-local ``--env-file`` (see secrets_env).

Fail fast
    A rank whose own run fails (non-zero exit, error pattern, timeout, cancel, or an infrastructure error) writes
    the attempt's ``ABORT`` marker (JSON ``{"rank", "node", "reason"}``, created with O_EXCL: the first writer wins).
    Every rank polls for it while waiting and stops its container, so healthy ranks do not hang in a collective
    until their timeout.

Verdict
    A model failure is data: the node's ``status.json`` says FAILURE with the reason, and the call returns.
    Only infrastructure errors (docker unreachable, image missing, results dir unwritable, bad input) raise
    `ModelRunError`. Containers are never run with ``--rm``: a failed one is snapshotted (container_diagnostics)
    into ``diagnostics.txt`` first, and every container is removed before the call returns.

Signals
    `install_cancel_handlers` turns SIGTERM/SIGINT/SIGHUP (scancel, the time limit, the controller gone) into a
    `Cancellation` the wait loop sees within ``poll_interval``; the run then takes a bounded snapshot (15 s) and
    stops the container with a 5 s grace, well inside SLURM's KillWait (30 s by default) before its SIGKILL.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ansible.module_utils import job_layout
from ansible.module_utils.abort_marker import read_abort_marker, write_abort_marker
from ansible.module_utils.container_diagnostics import DEFAULT_LOG_DIRS, write_container_diagnostics
from ansible.module_utils.docker_cli import DockerError, docker_argv, image_id, run_docker
from ansible.module_utils.docker_mounts import mount_args
from ansible.module_utils.gpu_devices import allocated_gpu_indices, docker_gpu_args, gpu_env
from ansible.module_utils.perf_lines import DEFAULT_ERROR_PATTERNS, scan_log_file
from ansible.module_utils.run_context import expand_placeholders, is_secret_name, placeholder_names
from ansible.module_utils.secrets_env import (
    SecretsError,
    check_secret_value,
    container_env_file,
    format_env_file,
    mask_secrets,
    mask_secrets_bytes,
    read_secrets_file,
)
from ansible.module_utils.stale_containers import LABEL_PREFIX, owner_labels

WORKSPACE = "/myworkspace"
SUCCESS = "SUCCESS"
FAILURE = "FAILURE"

CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CANCEL_STOP_GRACE = 5
CANCEL_LOG_DRAIN_TIMEOUT = 3.0
LOG_DRAIN_TIMEOUT = 30.0
DIAGNOSTICS_BUDGET = 15.0

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_MAX_LOG_LINE = 1 << 20
_ENV_FILE_PLACEHOLDER = "<node-local env file>"


class ModelRunError(Exception):
    """An infrastructure failure or bad input: the task must fail (a model failure is not one)."""


class Cancellation:
    """Set from a signal handler (or a test) to stop the run; the wait loop checks it every poll."""

    def __init__(self):
        self._reason = None  # type: Optional[str]

    def request(self, reason: str) -> None:
        """Ask the run to stop; the first reason is kept."""
        if self._reason is None:
            self._reason = reason

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self._reason is not None

    @property
    def reason(self) -> str:
        """Why the run was asked to stop."""
        return self._reason or ""


def install_cancel_handlers(cancellation: Cancellation) -> Callable[[], None]:
    """Route SIGTERM/SIGINT/SIGHUP to ``cancellation`` (main thread only); returns a function restoring the old ones."""

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        cancellation.request(f"cancelled by {name} (scancel, the job's time limit, or the controller gone)")

    previous = {signum: signal.signal(signum, handler) for signum in CANCEL_SIGNALS}

    def restore():
        for signum, old in previous.items():
            signal.signal(signum, old)

    return restore


@dataclass
class ModelRun:
    """Everything one node's run needs; the field names follow the run module's options."""

    job_id: str
    rank: int
    nnodes: int
    node: str
    model: str
    image: str
    model_dir: str
    script: str
    results_dir: str
    master_addr: str
    master_port: int
    # SLURM_RESTART_COUNT: a requeued job keeps its ID, each attempt writes under its own number.
    attempt: int = 0
    user: str = field(default_factory=lambda: current_user())
    model_args: Union[str, Sequence[str]] = ""
    docker_env_vars: Mapping[str, object] = field(default_factory=dict)
    docker_mounts: Mapping[str, str] = field(default_factory=dict)
    additional_docker_run_options: Union[str, Sequence[str]] = ""
    gpu_vendor: Optional[str] = None
    gpus: Sequence[Mapping[str, object]] = ()
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    timeout: Optional[float] = None
    job_end_time: Optional[float] = None
    end_margin: float = 120.0
    error_patterns: Sequence[str] = DEFAULT_ERROR_PATTERNS
    multiple_results: Optional[str] = None
    secrets_file: Optional[str] = None
    stop_grace: int = 10
    poll_interval: float = 0.5
    diagnostics_log_dirs: Sequence[str] = DEFAULT_LOG_DIRS
    diagnostics_budget: float = DIAGNOSTICS_BUDGET

    @property
    def container(self) -> str:
        """The container's name (docs/contracts.md)."""
        return container_name(self.job_id, self.rank)

    @property
    def attempt_dir(self) -> str:
        """``<results_dir>/<job_id>/attempt-<N>``: shared by every rank of this attempt (its ABORT marker)."""
        return job_layout.attempt_dir(self.results_dir, self.job_id, self.attempt)

    @property
    def node_dir(self) -> str:
        """``<attempt_dir>/nodes/<node>``: this node's log, status, CSVs and diagnostics for this attempt."""
        return job_layout.node_dir(self.results_dir, self.job_id, self.attempt, self.node)


@dataclass
class RunOutcome:
    """What a run did: the node's status (docs/contracts.md schema) and where its files are."""

    status: Dict[str, object]
    container: str
    started: bool
    log_path: str
    status_path: str
    diagnostics_path: Optional[str] = None
    results_csv: Optional[str] = None
    warnings: List[str] = field(default_factory=list)


def current_user() -> str:
    """The name of the user this process runs as (the owner of its containers)."""
    return pwd.getpwuid(os.geteuid()).pw_name


def container_name(job_id: str, rank: int) -> str:
    """``slurm-multi-<job_id>-r<rank>``."""
    return f"{LABEL_PREFIX}-{job_id}-r{rank}"


def container_labels(
    job_id: str, rank: int, user: str, model: str, environ: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The labels that name a job's container and its owner, for the stale-container cleanup (docs/contracts.md).

    ``environ`` is the run's environment (its SLURM_JOB_ID); the owner is this process, which waits for the
    container and removes it (module_utils/stale_containers.py).
    """
    return {
        f"{LABEL_PREFIX}.job": str(job_id),
        f"{LABEL_PREFIX}.rank": str(rank),
        f"{LABEL_PREFIX}.user": user,
        f"{LABEL_PREFIX}.model": model,
        **owner_labels(os.environ if environ is None else environ),
    }


def split_options(options: Union[str, Sequence[str], None], what: str = "options") -> List[str]:
    """Options given as one string (split like a shell would, without running one) or as an argv list."""
    if not options:
        return []
    if isinstance(options, str):
        try:
            return shlex.split(options)
        except ValueError as err:
            raise ModelRunError(f"{what} {options!r} cannot be split into arguments: {err}") from None
    return [str(option) for option in options]


def model_command(script: str, model_args: Union[str, Sequence[str]] = "") -> List[str]:
    """The argv the container runs, relative to the workspace: ``sh run.sh ...`` or the script itself."""
    args = split_options(model_args, "model_args")
    if script.endswith(".sh"):
        return ["sh", script, *args]
    return [f"./{script}" if "/" not in script else script, *args]


def _inside(base: str, relative: str, what: str) -> str:
    """``base/relative``, refusing absolute paths and paths that leave ``base``."""
    if os.path.isabs(relative):
        raise ModelRunError(f"{what} {relative!r} must be relative to the model dir {base}")
    path = os.path.realpath(os.path.join(base, relative))
    if os.path.commonpath([path, os.path.realpath(base)]) != os.path.realpath(base):
        raise ModelRunError(f"{what} {relative!r} leaves the model dir {base}")
    return path


def validate(run: ModelRun) -> None:
    """Refuse input that would break names, paths or the run, with a message saying what to fix."""
    if not _JOB_ID.match(str(run.job_id)):
        raise ModelRunError(
            f"job_id {run.job_id!r} is not usable in a container name: use letters, digits, '_', '.', '-' "
            "(the SLURM_JOB_ID)"
        )
    if not run.node or "/" in run.node or run.node in (".", ".."):
        raise ModelRunError(f"node {run.node!r} is not a host name")
    if run.nnodes < 1 or not 0 <= run.rank < run.nnodes:
        raise ModelRunError(f"rank {run.rank} is not in 0..{run.nnodes - 1} (nnodes={run.nnodes})")
    if not os.path.isdir(run.model_dir):
        raise ModelRunError(f"model_dir {run.model_dir} is not a directory on {run.node}")
    if not run.script:
        raise ModelRunError("script is empty: give the model's script, relative to the model dir")
    if not os.path.isfile(_inside(run.model_dir, run.script, "script")):
        raise ModelRunError(f"script {run.script} not found in the model dir {run.model_dir}")
    if run.multiple_results:
        _inside(run.model_dir, run.multiple_results, "multiple_results")
    if "--rm" in split_options(run.additional_docker_run_options, "additional_docker_run_options"):
        raise ModelRunError(
            "additional_docker_run_options holds --rm: remove it; slurm-multi removes its containers itself, "
            "after taking diagnostics of a failed one"
        )
    split_options(run.model_args, "model_args")  # an unbalanced quote fails here, before anything starts


def docker_run_args(run: ModelRun, env_file: Optional[str]) -> List[str]:
    """The ``docker`` arguments (``run ...``) for this node; ``env_file`` carries the user environment and secrets."""
    extra_options = split_options(run.additional_docker_run_options, "additional_docker_run_options")
    argv = ["run", "-d", "--init", "--name", run.container]
    for key, value in container_labels(run.job_id, run.rank, run.user, run.model, run.environ).items():
        argv += ["--label", f"{key}={value}"]
    if not any(option.split("=", 1)[0] in ("--network", "--net") for option in extra_options):
        argv.append("--network=host")  # NCCL/RCCL and MASTER_ADDR need the node's own interfaces
    argv += ["--workdir", WORKSPACE]
    topology = {
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.master_port),
        "NNODES": str(run.nnodes),
        "NODE_RANK": str(run.rank),
    }
    gpu_arguments = []  # type: List[str]
    if run.gpu_vendor:
        try:
            indices = allocated_gpu_indices(run.environ)
            topology.update(gpu_env(run.gpu_vendor, indices))
            gpu_arguments = docker_gpu_args(run.gpu_vendor, indices, list(run.gpus))
        except ValueError as err:
            raise ModelRunError(f"cannot give the container its GPUs: {err}") from None
    # The docker CLI applies -e after --env-file: the topology wins over a docker_env_vars entry of that name.
    for name, value in topology.items():
        argv += ["-e", f"{name}={value}"]
    if env_file:
        argv += ["--env-file", env_file]
    argv += gpu_arguments
    # The model dir goes first: where a context mount names the same target, the first one wins.
    mounts = {WORKSPACE: os.path.realpath(run.model_dir)}
    mounts.update((target, source) for target, source in (run.docker_mounts or {}).items() if target != WORKSPACE)
    try:
        argv += mount_args(mounts, extra_options)
    except ValueError as err:
        raise ModelRunError(f"cannot mount into the container: {err}") from None
    argv += extra_options
    argv.append(run.image)
    argv += model_command(run.script, run.model_args)
    return argv


@dataclass
class ContainerEnvironment:
    """The container's user environment, which of its values are secret (the only ones masked), and warnings."""

    variables: Dict[str, str]
    secret_values: List[str]
    warnings: List[str]


def container_environment(
    docker_env_vars: Optional[Mapping[str, object]],
    secrets: Mapping[str, str],
) -> ContainerEnvironment:
    """The container's user environment (``docker_env_vars`` and the job's secrets), its secret values, warnings.

    Every secret is passed under its own name and wins over a ``docker_env_vars`` entry of that name (a manifest
    may hold a stale literal: the HF 401 bug). By the time ``docker_env_vars`` gets here the run context has
    resolved references to the environment; what placeholders remain (``${NAME}``, ``$NAME``) can only be
    secrets: they get the secret's value, and a variable whose placeholder has none is dropped with a warning,
    never passed literally.

    Secret values, the only ones masked in logs, reasons and diagnostics: the secrets' own, the value of any
    other ``MAD_SECRETS_*`` variable, and every value a placeholder resolved to. Ordinary values
    (``OMP_NUM_THREADS=4``) are data and stay as they are. A secret shorter than ``MIN_SECRET_LENGTH`` is
    refused (SecretsError): masking it would shred the log.
    """
    variables = {}  # type: Dict[str, str]
    secret_values = []  # type: List[str]
    warnings = []  # type: List[str]
    for name, value in (docker_env_vars or {}).items():
        name, value = str(name), "" if value is None else str(value)
        if name in secrets:
            continue  # the secret's own value wins
        expanded = expand_placeholders(value, secrets)
        if expanded is None:
            missing = sorted(set(placeholder_names(value)) - set(secrets))
            warnings.append(
                f"docker_env_vars: {name} left unset: nothing gives {', '.join('${%s}' % ref for ref in missing)} "
                "a value (put secrets in the job's secrets file, export other variables before the run)"
            )
            continue
        if is_secret_name(name):
            check_secret_value(name, expanded, "docker_env_vars: ")
        if is_secret_name(name) or placeholder_names(value):
            secret_values.append(expanded)
        variables[name] = expanded
    for name, value in secrets.items():
        check_secret_value(name, value)
        secret_values.append(value)
    variables.update(secrets)
    return ContainerEnvironment(variables, [value for value in secret_values if value], warnings)


def _container_env(run: ModelRun) -> ContainerEnvironment:
    """The environment for the env file, checked to fit in one (names, no line breaks) before anything starts."""
    try:
        secrets = read_secrets_file(run.secrets_file) if run.secrets_file else {}
        environment = container_environment(run.docker_env_vars, secrets)
        format_env_file(environment.variables)
    except SecretsError as err:
        raise ModelRunError(str(err)) from None
    return environment


def plan_model_run(run: ModelRun) -> Dict[str, object]:
    """What a run would do (check mode): the docker argv, the names of the container's variables, warnings."""
    validate(run)
    environment = _container_env(run)
    argv = docker_argv(docker_run_args(run, _ENV_FILE_PLACEHOLDER if environment.variables else None))
    return {
        "container": run.container,
        "docker_run_argv": [mask_secrets(arg, environment.secret_values) for arg in argv],
        "env_file_variables": sorted(environment.variables),
        "warnings": environment.warnings,
    }


# ---------------------------------------------------------------------------------------------- results dir files


def write_json_atomically(path: str, data: Mapping[str, object]) -> None:
    """Write JSON by temp file + rename: a reader sees the old file or the new one, never half of one."""
    tmp_path = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp_path, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2, sort_keys=True)
            out.write("\n")
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)


def _file_signature(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


# ---------------------------------------------------------------------------------------------------- docker calls


def _docker(args: Sequence[str], timeout: float = 60.0):
    return run_docker(list(args), timeout=timeout)


def _remove_container(name: str) -> None:
    try:
        _docker(["rm", "-f", name], timeout=30)
    except DockerError as err:
        if "No such container" not in str(err):
            raise


def _container_state(name: str) -> Tuple[bool, Optional[int]]:
    completed = _docker(
        ["inspect", "--type", "container", "--format", "{{.State.Running}} {{.State.ExitCode}}", name], timeout=30
    )
    running, _, exit_code = completed.stdout.strip().partition(" ")
    return running == "true", int(exit_code) if exit_code.lstrip("-").isdigit() else None


class _LogFollower:
    """``docker logs -f`` of the container into the node's run.log, with secret values masked line by line."""

    def __init__(self, container: str, path: str, secret_values: Iterable[str]):
        self.container = container
        self.path = path
        self.secret_values = list(secret_values)
        self._process = None  # type: Optional[subprocess.Popen]
        self._thread = None  # type: Optional[threading.Thread]

    def start(self, follow: bool = True) -> "_LogFollower":
        out = open(self.path, "wb")
        command = docker_argv(["logs", *(["--follow"] if follow else []), self.container])
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._thread = threading.Thread(target=self._pump, args=(self._process.stdout, out), daemon=True)
        self._thread.start()
        return self

    def _pump(self, source, out) -> None:
        with out, source:
            for line in iter(lambda: source.readline(_MAX_LOG_LINE), b""):
                out.write(mask_secrets_bytes(line, self.secret_values))
                out.flush()

    def finish(self, timeout: float) -> bool:
        """Wait for the log to drain (the follow ends with the container); False when it did not end cleanly."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._process.kill()
            self._thread.join(5)
        return self._process.wait() == 0


# --------------------------------------------------------------------------------------------------------- the run


def _deadline(run: ModelRun) -> Tuple[Optional[float], str]:
    """(monotonic deadline, why) from the model's timeout and the job's end minus the margin; (None, "") if none."""
    candidates = []
    if run.timeout:
        candidates.append((time.monotonic() + run.timeout, f"the model's timeout of {run.timeout:g} s was reached"))
    if run.job_end_time:
        ends = datetime.datetime.fromtimestamp(run.job_end_time, datetime.timezone.utc).isoformat(timespec="seconds")
        left = run.job_end_time - run.end_margin - time.time()
        candidates.append(
            (time.monotonic() + left, f"the job ends at {ends}: stopped {run.end_margin:g} s before its end")
        )
    return min(candidates) if candidates else (None, "")


class _NodeRun:
    """One run's state, so that every way out (exit, abort, timeout, cancel, error) records the same fields."""

    def __init__(self, run: ModelRun, cancellation: Cancellation):
        self.run = run
        self.cancellation = cancellation
        self.log_path = os.path.join(run.node_dir, "run.log")
        self.status_path = os.path.join(run.node_dir, "status.json")
        self.diagnostics_path = None  # type: Optional[str]
        self.results_csv = None  # type: Optional[str]
        self.secret_values = []  # type: List[str]
        self.warnings = []  # type: List[str]
        self.started = False
        self.status = {
            "node": run.node, "rank": run.rank, "nnodes": run.nnodes, "job_id": str(run.job_id),
            "model": run.model, "status": SUCCESS, "exit_code": None, "error_pattern": None,
            "aborted_by_rank": None, "cancelled": False, "timed_out": False, "perf_lines": 0, "reason": "",
            "started_at": time.time(), "ended_at": None,
        }  # type: Dict[str, object]

    def fail(self, reason: str, **fields) -> None:
        self.status.update(fields)
        self.status["status"] = FAILURE
        reasons = [r for r in (self.status["reason"], reason) if r]
        self.status["reason"] = mask_secrets("; ".join(reasons), self.secret_values)

    def raise_abort(self) -> None:
        """Tell the other ranks to stop (fail fast); the first rank's marker stands."""
        try:
            write_abort_marker(self.run.attempt_dir, self.run.rank, self.run.node, str(self.status["reason"]))
        except OSError as err:
            self.warnings.append(f"could not write the abort marker in {self.run.attempt_dir}: {err}")

    def snapshot(self) -> None:
        """Diagnostics beside the log; a failure to write them is a warning, the run's failure stands."""
        path = os.path.join(self.run.node_dir, "diagnostics.txt")
        try:
            self.diagnostics_path = write_container_diagnostics(
                path, self.run.container, log_dirs=self.run.diagnostics_log_dirs,
                secret_values=self.secret_values, budget=self.run.diagnostics_budget,
                reason=str(self.status["reason"]),
            )
        except OSError as err:
            self.warnings.append(f"could not write {path}: {err}")

    def write_status(self) -> None:
        self.status["ended_at"] = time.time()
        try:
            write_json_atomically(self.status_path, self.status)
        except OSError as err:
            raise ModelRunError(f"cannot write {self.status_path}: {err}") from None


def _start_waiter(name: str) -> subprocess.Popen:
    # `docker wait` blocks in the daemon until the container ends: no polling of docker while the model runs.
    return subprocess.Popen(
        docker_argv(["wait", name]), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _wait(run: ModelRun, cancellation: Cancellation, deadline: Optional[float]) -> Tuple[str, object]:
    """Wait for the container: ("exited", None), ("aborted", marker), ("timed_out", None) or ("cancelled", None)."""
    waiter = _start_waiter(run.container)
    try:
        while True:
            if cancellation.requested:
                return "cancelled", None
            if waiter.poll() is not None:
                running, _ = _container_state(run.container)
                if not running:
                    return "exited", None
                # The waiter died while the container runs on (a signal meant for us, a daemon hiccup): rewatch.
                waiter = _start_waiter(run.container)
            marker = read_abort_marker(run.attempt_dir)
            if marker is not None:
                return "aborted", marker
            if deadline is not None and time.monotonic() >= deadline:
                return "timed_out", None
            time.sleep(run.poll_interval)
    finally:
        if waiter.poll() is None:
            waiter.kill()
        waiter.wait()


def _stop(name: str, grace: int) -> None:
    _docker(["stop", "-t", str(grace), name], timeout=grace + 30)


def _abort_reason(marker: Mapping[str, object]) -> str:
    return f"aborted because rank {marker.get('rank')} ({marker.get('node')}) failed: {marker.get('reason')}"


def _finish_log(follower: _LogFollower, timeout: float) -> None:
    """Wait for the log to drain; if following broke off (a signal), fetch the whole log again into run.log."""
    if not follower.finish(timeout):
        _LogFollower(follower.container, follower.path, follower.secret_values).start(follow=False).finish(timeout)


def _scan_log(node_run: _NodeRun, judge: bool) -> None:
    """Count the perf lines and find an error pattern; ``judge``: a hit makes the node fail (its own end)."""
    scan = scan_log_file(node_run.log_path, node_run.run.error_patterns)
    node_run.status["perf_lines"] = len(scan.perf_lines)
    node_run.status["error_pattern"] = scan.error_pattern
    if judge and scan.error_pattern is not None:
        node_run.fail(f"error pattern {scan.error_pattern!r} in the log: {(scan.error_line or '')[:300]}")


def _copy_results_csv(node_run: _NodeRun, before: Optional[Tuple[int, int, int]]) -> Optional[str]:
    """Copy the model's multiple-results CSV into the node dir, unless it is the same file as before the run."""
    run = node_run.run
    if not run.multiple_results:
        return None
    source = _inside(run.model_dir, run.multiple_results, "multiple_results")
    signature = _file_signature(source)
    if signature is None:
        node_run.warnings.append(f"the model wrote no {run.multiple_results}")
        return None
    if signature == before:
        node_run.warnings.append(f"{run.multiple_results} was not rewritten by this run: not copied")
        return None
    target = os.path.join(run.node_dir, os.path.basename(source))
    shutil.copyfile(source, target)
    return target


def run_model_container(run: ModelRun, cancellation: Optional[Cancellation] = None) -> RunOutcome:
    """Run this node's container to its end and write the node's status.json; see the module docstring.

    Raises ModelRunError for infrastructure errors and bad input (after writing the abort marker and a FAILURE
    status when the results dir is usable, so the other ranks stop too).
    """
    cancellation = cancellation or Cancellation()
    validate(run)
    try:
        os.makedirs(run.node_dir, exist_ok=True)
        if not os.access(run.node_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as err:
        raise ModelRunError(f"the results dir {run.node_dir} is not usable on {run.node}: {err}") from None
    node_run = _NodeRun(run, cancellation)
    try:
        _run(node_run)
    except (ModelRunError, DockerError, OSError) as err:
        message = mask_secrets(str(err), node_run.secret_values)
        node_run.fail(f"infrastructure error: {message}")
        node_run.raise_abort()
        try:
            node_run.write_status()
        except ModelRunError:
            pass  # the results dir is what broke: the error below says so
        raise ModelRunError(message) from None
    return RunOutcome(
        status=node_run.status, container=run.container, started=node_run.started, log_path=node_run.log_path,
        status_path=node_run.status_path, diagnostics_path=node_run.diagnostics_path,
        results_csv=node_run.results_csv, warnings=node_run.warnings,
    )


def _run(node_run: _NodeRun) -> None:
    run = node_run.run
    environment = _container_env(run)
    node_run.secret_values = environment.secret_values
    node_run.warnings += environment.warnings
    deadline, deadline_reason = _deadline(run)

    marker = read_abort_marker(run.attempt_dir)
    if marker is not None:
        node_run.fail(_abort_reason(marker), aborted_by_rank=marker.get("rank"))
    elif node_run.cancellation.requested:
        node_run.fail(node_run.cancellation.reason, cancelled=True)
        node_run.raise_abort()
    elif deadline is not None and deadline <= time.monotonic():
        node_run.fail(f"not started: {deadline_reason}", timed_out=True)
        node_run.raise_abort()
    if node_run.status["status"] == FAILURE:
        node_run.write_status()
        return

    if image_id(run.image) is None:
        raise ModelRunError(
            f"image {run.image} is not on {run.node}'s docker daemon: the build stage should have loaded it"
        )
    _remove_container(run.container)  # a leftover of an earlier attempt of this very job and rank
    csv_before = (
        _file_signature(_inside(run.model_dir, run.multiple_results, "multiple_results"))
        if run.multiple_results else None
    )
    try:
        env_file_block = container_env_file(environment.variables) if environment.variables else None
        with env_file_block or contextlib.nullcontext() as env_file:
            node_run.status["started_at"] = time.time()
            _docker(docker_run_args(run, env_file), timeout=120)
        node_run.started = True
        _follow_to_the_end(node_run, deadline, deadline_reason)
        node_run.results_csv = _copy_results_csv(node_run, csv_before)
    finally:
        # Also after a failed start: `docker run` leaves a created container behind when the start fails.
        try:
            _remove_container(run.container)
        except DockerError as err:
            node_run.warnings.append(f"could not remove {run.container} (the next job's cleanup will): {err}")
    node_run.write_status()


def _follow_to_the_end(node_run: _NodeRun, deadline: Optional[float], deadline_reason: str) -> None:
    run = node_run.run
    follower = _LogFollower(run.container, node_run.log_path, node_run.secret_values).start()
    ending, marker = _wait(run, node_run.cancellation, deadline)

    if ending == "exited":
        _finish_log(follower, LOG_DRAIN_TIMEOUT)
        _, exit_code = _container_state(run.container)
        node_run.status["exit_code"] = exit_code
        if exit_code != 0:
            node_run.fail(f"the container exited with code {exit_code}")
        _scan_log(node_run, judge=True)
        if node_run.status["status"] == FAILURE:
            node_run.raise_abort()
            node_run.snapshot()
        return

    if ending == "aborted":
        node_run.fail(_abort_reason(marker), aborted_by_rank=marker.get("rank"))
        _stop(run.container, run.stop_grace)
    else:
        if ending == "cancelled":
            node_run.fail(node_run.cancellation.reason, cancelled=True)
        else:
            node_run.fail(deadline_reason, timed_out=True)
        node_run.raise_abort()
        node_run.snapshot()  # still running: the snapshot looks inside before it stops
        _stop(run.container, CANCEL_STOP_GRACE if ending == "cancelled" else run.stop_grace)
    # After a signal, SLURM's SIGKILL comes KillWait (30 s) after its SIGTERM: drain the log briefly.
    _finish_log(follower, CANCEL_LOG_DRAIN_TIMEOUT if ending == "cancelled" else LOG_DRAIN_TIMEOUT)
    node_run.status["exit_code"] = _container_state(run.container)[1]
    _scan_log(node_run, judge=False)  # the stop is the reason; a pattern hit is still worth recording
    if ending == "aborted":
        node_run.snapshot()
