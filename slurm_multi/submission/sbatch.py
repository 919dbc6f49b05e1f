"""The job's sbatch scripts (rendered from Jinja2 templates) and the SLURM commands that submit and watch them.

Two scripts per submission: the job itself (the pipeline, then collect.yml whatever happened) and a one-node collect
job queued ``--dependency=afterany`` on it, which records the job even when it never got to (cancelled, time limit,
node failure). User values reach the scripts only as SLURM option values validated to be single words, and as paths
quoted for the shell; everything the pipeline reads goes through the job's JSON vars file.
"""

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Self

import jinja2

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import (
    MODULE_NAME,
    SLURM_REQUEST_KEYS,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import DEFAULT_MODE, MODES, PULL
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    expand_nodelist,
    is_slurm_job_id,
)
from slurm_multi import __version__
from slurm_multi.errors import SbatchError, SlurmMultiError
from slurm_multi.submission.job_vars import VARS_FILE_NAME

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
# The early warning (`--signal=B:USR1@<s>`): time to stop the model, snapshot diagnostics and collect.
EARLY_WARNING_SECONDS = 180
MIN_EARLY_WARNING_SECONDS = 10
# After the pipeline's main process exits, how long its stopped run module may take to write its status.
DRAIN_SECONDS = 60
COLLECT_JOB_TIME = SETTING_DEFAULTS["collect_job_time"]
COLLECT_JOB_NAME = "slurm-multi-collect"
DEFAULT_JOB_NAME = "slurm-multi"
SLURM_COMMAND_TIMEOUT = 60

# SLURM's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; or no limit.
_TIME = re.compile(r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(?::\d{1,2}){0,2}|UNLIMITED|INFINITE)$", re.I)
# `--gpus-per-node`: [type:]count, e.g. 8 or mi300x:8.
_GPUS = re.compile(r"^(?:[A-Za-z0-9_.-]+:)?\d+$")
_FORBIDDEN_IN_WORD = re.compile(r"[\s'\"\\`#]|[\x00-\x1f\x7f]")
# `--mem`: a size, in MB without a unit, else K, M, G or T (0: all of the node's memory).
_MEM = re.compile(r"^\d+[KMGT]?$", re.I)


# The collect job's settings (module_utils/job/defaults.py) and the SlurmOptions field each sets.
COLLECT_JOB_SETTINGS = {
    "collect_job_partition": "collect_partition",
    "collect_job_account": "collect_account",
    "collect_job_qos": "collect_qos",
    "collect_job_time": "collect_time",
    "collect_job_gpus": "collect_gpus",
}

# The options given as one word (the `slurm` keys but the node count and the exclusive flag), and the job's name.
WORD_OPTIONS = tuple(key for key in SLURM_REQUEST_KEYS if key not in ("nodes", "exclusive")) + ("job_name",)


@dataclass(frozen=True)
class SlurmOptions:
    """The job's SLURM request; None means "not set": no SBATCH line, the cluster's default applies."""

    nodes: int
    partition: str | None = None
    reservation: str | None = None
    nodelist: str | None = None
    exclude: str | None = None
    time: str | None = None
    gpus_per_node: str | None = None
    account: str | None = None
    qos: str | None = None
    exclusive: bool = True
    mem: str | None = None
    constraint: str | None = None
    # Environment modules the job script loads before the pipeline (madengine's slurm.modules).
    modules: tuple = ()
    job_name: str = DEFAULT_JOB_NAME
    early_warning_seconds: int = EARLY_WARNING_SECONDS
    # The afterany collect job's own request (the collect_job_* settings): None or "" takes the job's partition,
    # account and QOS; no GPU request unless collect_job_gpus gives one.
    collect_partition: str | None = None
    collect_account: str | None = None
    collect_qos: str | None = None
    collect_time: str = COLLECT_JOB_TIME
    collect_gpus: str | None = None

    def validated(self) -> Self:
        """These options, or a SbatchError naming the option, the value and the form SLURM expects."""
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise SbatchError(f"--nodes must be a whole number of nodes, 1 or more (got {self.nodes!r})")
        for name in WORD_OPTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            option = "--" + name.replace("_", "-")
            if not isinstance(value, str) or not value:
                raise SbatchError(f"{option} must be a non-empty string (got {value!r})")
            if _FORBIDDEN_IN_WORD.search(value):
                raise SbatchError(
                    f"{option} {value!r} contains whitespace, a quote, '#', a backslash or a control character; "
                    "SLURM names and values have none"
                )
        for name in ("nodelist", "exclude"):
            value = getattr(self, name)
            if value is not None:
                try:
                    expand_nodelist(value, f"--{name}", allow_duplicates=True)
                except AllocationError as exc:
                    raise SbatchError(str(exc)) from None
        if self.time is not None and not _TIME.match(self.time):
            raise SbatchError(
                f"--time {self.time!r} is not a SLURM time limit: use minutes (90), HH:MM:SS (01:30:00) "
                "or D-HH:MM:SS (1-12:00:00)"
            )
        if self.gpus_per_node is not None and not _GPUS.match(self.gpus_per_node):
            raise SbatchError(f"--gpus-per-node {self.gpus_per_node!r} must be a count (8) or type:count (mi300x:8)")
        if self.mem is not None and not _MEM.match(self.mem):
            raise SbatchError(
                f"--mem {self.mem!r} (slurm.mem) is not a SLURM memory size: give 256G, 512000M or 0 (all of it)"
            )
        modules = self.modules if isinstance(self.modules, (list, tuple)) else [self.modules]
        for module in modules:
            if not isinstance(module, str) or not MODULE_NAME.match(module):
                raise SbatchError(
                    f"slurm.modules entry {module!r} is no environment module name (rocm/6.2.0, gcc/11.2.0)"
                )
        self._validated_collect_job()
        return self

    def _validated_collect_job(self) -> None:
        for name, setting in (
            ("collect_partition", "collect_job_partition"),
            ("collect_account", "collect_job_account"),
            ("collect_qos", "collect_job_qos"),
            ("collect_gpus", "collect_job_gpus"),
            ("collect_time", "collect_job_time"),
        ):
            value = getattr(self, name)
            if value in (None, ""):
                continue
            if not isinstance(value, str) or _FORBIDDEN_IN_WORD.search(value):
                raise SbatchError(f"{setting} {value!r} must be one word, as SLURM names and values are")
        if self.collect_gpus and not _GPUS.match(self.collect_gpus):
            raise SbatchError(
                f"collect_job_gpus {self.collect_gpus!r} must be a count (1) or type:count (mi300x:1), or empty"
            )
        if not self.collect_time or not _TIME.match(self.collect_time):
            raise SbatchError(
                f"collect_job_time {self.collect_time!r} is not a SLURM time limit: use minutes (15) or HH:MM:SS "
                "(00:15:00)"
            )
        if not isinstance(self.early_warning_seconds, int) or self.early_warning_seconds < 1:
            raise SbatchError(
                f"the early warning must be a positive number of seconds (got {self.early_warning_seconds!r})"
            )

    def time_limit_seconds(self) -> int | None:
        """The time limit in seconds, None when unset or unlimited."""
        if self.time is None or self.time.upper() in ("UNLIMITED", "INFINITE"):
            return None
        days, _, clock = self.time.rpartition("-")
        parts = [int(part) for part in clock.split(":")]
        if days:  # D-HH[:MM[:SS]]
            hours, minutes, seconds = (parts + [0, 0])[:3]
            return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
        if len(parts) == 1:  # minutes
            return parts[0] * 60
        if len(parts) == 2:  # MM:SS
            return parts[0] * 60 + parts[1]
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]

    def early_warning(self) -> int:
        """Seconds before the time limit that the early warning comes: a quarter of a short limit at most."""
        limit = self.time_limit_seconds()
        if limit is None or limit >= 4 * self.early_warning_seconds:
            return self.early_warning_seconds
        # A 2-minute smoke test must not be told to stop the moment it starts.
        return max(limit // 4, MIN_EARLY_WARNING_SECONDS)

    def with_collect_job(self, settings: Mapping[str, object]) -> Self:
        """These options with the collect job's request from ``settings`` (the collect_job_* settings by name; one
        empty or missing keeps the default: the job's partition, account and QOS, no GPUs, COLLECT_JOB_TIME)."""
        chosen = {}
        for setting, name in COLLECT_JOB_SETTINGS.items():
            value = settings.get(setting)
            if value not in (None, ""):
                chosen[name] = value if isinstance(value, str) else str(value)
        return replace(self, **chosen)

    def for_collect_job(self) -> Self:
        """The collect job's request: one node, shared, its own time and GPU request (none by default), its own
        partition, account and QOS where set, else the job's. In another partition the job's reservation and
        node constraints do not apply: they name the job's nodes."""
        other_partition = bool(self.collect_partition) and self.collect_partition != self.partition
        return replace(
            self,
            nodes=1,
            nodelist=None,
            exclude=None if other_partition else self.exclude,
            reservation=None if other_partition else self.reservation,
            constraint=None if other_partition else self.constraint,
            partition=self.collect_partition or self.partition,
            account=self.collect_account or self.account,
            qos=self.collect_qos or self.qos,
            gpus_per_node=self.collect_gpus or None,
            time=self.collect_time,
            # Collecting reads files: whatever memory and modules the model's job asked for, it needs none of them.
            mem=None,
            modules=(),
            exclusive=False,
            job_name=COLLECT_JOB_NAME,
        )


def slurm_time(seconds: float) -> str:
    """``seconds`` as a value `--time` takes, rounded up to the minute: ``HH:MM:SS``, or ``D-HH:MM:SS`` from a day."""
    minutes = math.ceil(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    clock = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{clock}" if days else clock


def _sbatch_path(path: Path) -> str:
    """A path for an ``#SBATCH --output="..."`` line: sbatch reads double quotes, and ``%`` is its pattern sign."""
    text = str(path)
    if '"' in text or re.search(r"[\x00-\x1f\x7f]", text):
        raise SbatchError(f"the path {text!r} holds a double quote or a control character, which sbatch cannot read")
    return text.replace("%", "%%")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["shell"] = lambda value: shlex.quote(str(value))
    return env


# The per-node command of pull mode's step: each task runs run_multi.yml against its own node (SLURMD_NODENAME) with
# the local connection, under pull_node.py, which outlives ansible-playbook until the run module is done when SLURM
# stops the job (that file says why). By path: the nodes need the venv's interpreter, not the package.
PULL_NODE_SCRIPT = Path(__file__).resolve().parent.parent / "pull_node.py"
# What a node's part of a pull-mode run adds to the job's vars (data, never templated).
PULL_NODE_VARS = json.dumps({"mode": PULL, "ansible_connection": "local"})


def pull_step_argv(ansible_playbook: Path, playbooks: Path, vars_file: Path, nodes: int) -> list[str]:
    """Pull mode's one srun step: run_multi.yml on every node at once, each node against itself.

    One task per node. ``--kill-on-bad-exit=0``: a node that fails must not get the others SIGKILLed (their
    containers would stay); it leaves the ABORT marker, which stops them with their diagnostics. ``--label``
    prefixes each line with the task's rank, so the interleaved output stays readable (progress.py reads it).
    ``--overlap`` lets the step share the nodes with other steps of the job (a user's own, the lab tests').
    srun runs under slurm_multi.pull_step, which gives the step its run nonce and ends it when a node is lost.
    """
    return [
        sys.executable, "-m", "slurm_multi.pull_step", str(vars_file), "--",
        "srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--overlap",
        "--label",
        sys.executable, str(PULL_NODE_SCRIPT), str(ansible_playbook), str(Path(playbooks) / "run_multi.yml"),
        "-e", f"@{vars_file}", "-e", PULL_NODE_VARS,
    ]  # fmt: skip


def render_job_script(
    slurm: SlurmOptions,
    root: Path,
    ansible_playbook: Path,
    vars_file: Path,
    output_dir: Path,
    results_dir: Path,
    mode: str = DEFAULT_MODE,
    sweep: bool = False,
) -> str:
    """The job's sbatch script: the pipeline (a sweep's: once per image, slurm_multi.submission.sweep), then
    collect.yml unless the pipeline wrote the record. Push mode runs run_multi.yml with one fork per node, pull mode
    `pull_step_argv`. ``root`` holds ansible.cfg and playbooks/; ``output_dir`` receives ``slurm-<job id>.out``."""
    slurm = slurm.validated()
    if mode not in MODES:
        raise SbatchError(f"mode {mode!r} is neither push nor pull")
    pull_step = pull_step_argv(ansible_playbook, Path(root) / "playbooks", vars_file, slurm.nodes)
    template = _environment().get_template("job.sbatch.j2")
    return template.render(
        version=__version__,
        slurm=asdict(slurm),
        early_warning=slurm.early_warning(),
        output=_sbatch_path(Path(output_dir) / "slurm-") + "%j.out",
        root=str(root),
        ansible_playbook=str(ansible_playbook),
        vars_file=str(vars_file),
        drain_seconds=DRAIN_SECONDS,
        records_dir=job_layout.records_dir(str(results_dir)),
        pull_mode=mode == PULL,
        pull_step=shlex.join(pull_step),
        sweep=sweep,
        python=sys.executable,
    )


def render_collect_script(slurm: SlurmOptions, job_id: str, python: Path, vars_file: Path, output_dir: Path) -> str:
    """The afterany collect job's script for job ``job_id`` (``slurm`` are the main job's options)."""
    template = _environment().get_template("collect.sbatch.j2")
    return template.render(
        version=__version__,
        slurm=asdict(slurm.validated().for_collect_job()),
        output=_sbatch_path(Path(output_dir) / "collect-") + "%j.out",
        job_id=job_id,
        python=str(python),
        vars_file=str(vars_file),
    )


def job_output_path(output_dir: Path, job_id: str) -> Path:
    """Where the job's own output (the pipeline's Ansible output) goes."""
    return Path(output_dir) / f"slurm-{job_id}.out"


def _run_slurm_command(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT
        )
    except FileNotFoundError:
        raise SbatchError(f"`{argv[0]}` is not on PATH: run this on a SLURM login node") from None
    except subprocess.TimeoutExpired:
        command = " ".join(argv[:2])
        raise SbatchError(f"`{command}` gave no answer in {SLURM_COMMAND_TIMEOUT} s: is slurmctld up?") from None


def _check(result: subprocess.CompletedProcess, what: str) -> str:
    if result.returncode != 0:
        raise SbatchError(f"{what} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def submit_script(script: Path, env: Mapping[str, str], cwd: Path | None = None, hold: bool = False) -> str:
    """Submit ``script`` with ``sbatch --parsable`` in environment ``env`` (exported to the job); return its ID.

    ``hold`` queues it held (it does not start before `release_job`).
    """
    argv = ["sbatch", "--parsable"] + (["--hold"] if hold else []) + [str(script)]
    answer = _check(_run_slurm_command(argv, env=env, cwd=cwd), f"sbatch {script}").strip()
    job_id = answer.split(";", 1)[0]
    if not is_slurm_job_id(job_id):
        raise SbatchError(f"sbatch answered {answer!r}, which holds no job ID")
    return job_id


def release_job(job_id: str) -> None:
    """Let a held job start."""
    _check(_run_slurm_command(["scontrol", "release", str(job_id)]), f"scontrol release {job_id}")


def cancel_job(job_id: str) -> None:
    """Cancel a job."""
    _check(_run_slurm_command(["scancel", str(job_id)]), f"scancel {job_id}")


def allocation_nodes(environ: Mapping[str, str]) -> list[str]:
    """The nodes of the allocation this runs in (``SLURM_JOB_NODELIST``), [] outside one."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    try:
        return expand_nodelist(nodelist) if nodelist else []
    except AllocationError as exc:
        raise SlurmMultiError(str(exc)) from None


def parse_scontrol_record(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (``Key=Value`` words on one line) as a dict."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(\S*)", text.strip()))


def job_info(job_id: str) -> dict[str, str] | None:
    """SLURM's view of a job (``JobState``, ``Reason``, ``NodeList``, ...), None once SLURM has forgotten it."""
    result = _run_slurm_command(["scontrol", "show", "job", "-o", str(job_id)])
    if result.returncode != 0 or "JobState=" not in result.stdout:
        return None
    return parse_scontrol_record(result.stdout.splitlines()[0])


# sinfo's node states (%T, long form) in which SLURM gives a node new jobs; a suffix such as `*` (not responding),
# `~` (powered off) or `$` (maintenance) makes a node unusable whatever its state.
_USABLE_NODE_STATES = frozenset(("idle", "allocated", "mixed", "completing", "reserved", "planned"))


def parse_sinfo_nodes(text: str, partition: str | None) -> list[str]:
    """The usable nodes of ``sinfo -h -N -o '%N %T %P'`` output, in its order, each once: those of ``partition``,
    else of the default partition (its name ends in ``*``)."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        name, state, node_partition = fields[:3]
        wanted = node_partition.rstrip("*") == partition if partition else node_partition.endswith("*")
        if wanted and state in _USABLE_NODE_STATES and name not in nodes:
            nodes.append(name)
    return nodes


def usable_nodes(partition: str | None = None, reservation: str | None = None) -> list[str]:
    """The nodes a job of ``partition`` (None: the default one) and ``reservation`` could get: up and responding
    in SLURM's view (sinfo), and in the reservation when one is given (scontrol show reservation)."""
    answer = _check(_run_slurm_command(["sinfo", "-h", "-N", "-o", "%N %T %P"]), "sinfo")
    nodes = parse_sinfo_nodes(answer, partition)
    if reservation:
        shown = _check(
            _run_slurm_command(["scontrol", "show", "reservation", "-o", reservation]),
            f"scontrol show reservation {reservation}",
        )
        listed = parse_scontrol_record(shown).get("Nodes", "")
        if not listed or listed == "(null)":
            raise SbatchError(f"reservation {reservation} lists no nodes (scontrol show reservation {reservation})")
        reserved = set(expand_nodelist(listed, f"reservation {reservation}'s Nodes"))
        nodes = [node for node in nodes if node in reserved]
    return nodes


# --- Queueing a job with its afterany collect job, and reading its state -----------------------------------------

JOB_SCRIPT_NAME = "job.sbatch"
COLLECT_SCRIPT_NAME = "collect.sbatch"
# SLURM job states in which a job may still run or write results.
ACTIVE_JOB_STATES = frozenset((
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
    "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
))  # fmt: skip


def find_ansible_playbook() -> Path:
    """The ansible-playbook the pipeline runs: this Python's environment's ``slurm-multi-playbook`` (ansible-playbook
    with its start-up caches, slurm_multi/speedup/playbook.py), else its ``ansible-playbook``, else the one on PATH."""
    for name in ("slurm-multi-playbook", "ansible-playbook"):
        beside = Path(sys.executable).parent / name
        if beside.is_file():
            return beside
    found = shutil.which("ansible-playbook")
    if found:
        return Path(found).absolute()
    raise SlurmMultiError(
        f"ansible-playbook is neither beside {sys.executable} nor on PATH: install ansible-core in this environment"
    )


class QueueError(Exception):
    """Queueing a job failed; ``job_id`` is the job that was queued held and then cancelled (None: none was)."""

    def __init__(self, message: str, job_id: str | None) -> None:
        super().__init__(message)
        self.job_id = job_id


def queue_job(
    slurm: SlurmOptions,
    root: Path,
    private_dir: Path,
    results_dir: Path,
    mode: str,
    sweep: bool,
    environment: Mapping[str, str],
    name_suffix: str = "",
) -> tuple[str, str]:
    """Write the job's scripts into ``private_dir`` (its vars file already there) and queue the job and its
    afterany collect job; return both IDs. The job is queued held until its collect job is queued.

    ``name_suffix`` tells a retry's scripts apart from the first submission's (``job-retry-1.sbatch``). A failure
    after the job was queued cancels it and raises QueueError naming it.
    """
    vars_file = private_dir / VARS_FILE_NAME
    job_script = private_dir / JOB_SCRIPT_NAME.replace(".sbatch", f"{name_suffix}.sbatch")
    job_script.write_text(
        render_job_script(slurm, root, find_ansible_playbook(), vars_file, private_dir, results_dir, mode, sweep)
    )
    job_id = submit_script(job_script, environment, cwd=private_dir, hold=True)
    try:
        collect_script = private_dir / COLLECT_SCRIPT_NAME.replace(".sbatch", f"{name_suffix}.sbatch")
        collect_script.write_text(render_collect_script(slurm, job_id, Path(sys.executable), vars_file, private_dir))
        collect_job_id = submit_script(collect_script, environment, cwd=private_dir)
        release_job(job_id)
    except BaseException as exc:
        try:
            cancel_job(job_id)
            cancelled = f"; job {job_id} was cancelled before it started"
        except SbatchError as cancel_error:
            cancelled = f"; job {job_id} is held and could not be cancelled ({cancel_error}): scancel it"
        if not isinstance(exc, Exception):
            raise  # Ctrl-C: the job is cancelled, the interrupt goes on
        raise QueueError(f"{exc}{cancelled}", job_id) from None
    return job_id, collect_job_id


def job_state(info: Mapping[str, str] | None) -> str | None:
    """SLURM's ``JobState`` of a `job_info` record; None once SLURM forgot the job."""
    return info.get("JobState") if info else None


def job_attempt(info: Mapping[str, str] | None) -> int | None:
    """The job's current attempt from SLURM (``Restarts``: how often it was requeued); None once SLURM forgot it."""
    restarts = (info or {}).get("Restarts", "")
    return int(restarts) if restarts.isdigit() else None


def job_exit_code(info: Mapping[str, str] | None) -> int | None:
    """The job's exit code from its ``ExitCode`` (``code:signal``); None when SLURM gives none."""
    try:
        return int((info or {}).get("ExitCode", "").split(":", 1)[0])
    except ValueError:
        return None
