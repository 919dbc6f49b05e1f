"""The Python API: run the pipeline in this allocation, submit it as a SLURM job and follow it, collect a job.

    from slurm_multi import api

    spec = api.job_spec(["dummy"], results_dir="/shared/results", additional_context='{"gpu_vendor": "AMD"}')
    result = api.run(spec, on_event=print)                         # inside salloc / sbatch
    submission = api.submit(spec, api.SlurmOptions(nodes=3, partition="gpu"))
    result = api.wait(submission, on_progress=print)               # from the login node
    result.status, result.per_node, result.perf                    # perf: a pandas DataFrame of the record's rows

Everything the pipeline reads goes to Ansible as extra vars from a JSON file, every string marked
``{"__ansible_unsafe": ...}``: ansible-core 2.19 trusts strings of ``-e @file`` as templates, and a model argument
such as ``{{ lookup('pipe', 'id') }}`` must stay the literal text the user gave. ``MAD_SECRETS_*`` never reach
Ansible's environment or variables: they go to a 0600 file whose path alone (``secrets_file``) the pipeline gets.

Bad input raises `SlurmMultiError` with a message that says what to fix; nothing has been submitted then.
"""

from __future__ import annotations

import json
import os
from secrets import token_hex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import pandas as pd

from slurm_multi import sbatch
from slurm_multi.paths import project_root, use_project_module_utils
from slurm_multi.progress import PipelineProgress
from slurm_multi.sbatch import SbatchError, SlurmOptions
from slurm_multi.secrets import secrets_file_text, split_secrets, without_secrets, write_secrets_file

use_project_module_utils()
from ansible.module_utils.build_manifest import ManifestError, load_model_cards, select_model_cards  # noqa: E402
from ansible.module_utils import job_layout  # noqa: E402
from ansible.module_utils.image_build import ImageBuildError, check_build_args  # noqa: E402
from ansible.module_utils.image_names import ImageNameError, normalize_registry  # noqa: E402
from ansible.module_utils.results_collection import (  # noqa: E402
    FAILURE,
    SUCCESS,
    ResultsCollectionError,
    load_record,
    record_path,
    regenerate_perf_csv,
    validate_job_id,
    write_failure_record,
)
from ansible.module_utils.run_context import (  # noqa: E402
    RunContextError,
    deep_merge,
    parse_additional_context,
    read_additional_context_file,
    secret_literals,
)
from ansible.module_utils.secrets_env import SecretsError  # noqa: E402
from ansible.module_utils.slurm_allocation import AllocationError, expand_nodelist  # noqa: E402

RESULTS_DIR_ENV = "SLURM_MULTI_RESULTS_DIR"
STATE_DIR_NAME = ".slurm-multi"
VARS_FILE_NAME = "vars.json"
JOB_SCRIPT_NAME = "job.sbatch"
COLLECT_SCRIPT_NAME = "collect.sbatch"
SUBMISSION_FILE_NAME = "submission.json"
# Shown in dry runs in place of the job ID that sbatch has not given yet.
JOB_ID_PLACEHOLDER = "<job id>"
UNSAFE_MARKER = "__ansible_unsafe"
# SLURM job states in which a job may still run or write results.
ACTIVE_JOB_STATES = frozenset(
    ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
     "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT")
)
# The keys of MAD's additional context `slurm` section that map onto submit options.
MAD_SLURM_KEYS = ("nodes", "partition", "reservation", "nodelist", "exclude", "time", "gpus_per_node", "account",
                  "qos", "exclusive")


class SlurmMultiError(Exception):
    """Bad input or an infrastructure problem, with a message that says what to do; exit code 2 on the CLI."""


_INPUT_ERRORS = (RunContextError, ImageNameError, ManifestError, SbatchError, SecretsError, ResultsCollectionError,
                 AllocationError, ImageBuildError)


# ---------------------------------------------------------------------------------------------------------------
# Where things go


def default_results_dir() -> Path:
    """``$SLURM_MULTI_RESULTS_DIR``, else ``~/slurm-multi-results`` (home directories are on shared storage)."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or Path.home() / "slurm-multi-results").absolute()


def private_jobs_dir() -> Path:
    """``~/.slurm-multi/jobs``: one 0700 directory per submission holding its script, vars and secrets files."""
    return Path.home() / STATE_DIR_NAME / "jobs"


def _new_private_dir() -> Path:
    base = private_jobs_dir()
    for directory in (base.parent, base):
        directory.mkdir(mode=0o700, exist_ok=True)
    path = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{token_hex(3)}"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # whatever the umask
    return path


def find_ansible_playbook() -> Path:
    """The ``ansible-playbook`` of this Python's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    if beside.is_file():
        return beside
    found = shutil.which("ansible-playbook")
    if found:
        return Path(found).absolute()
    raise SlurmMultiError(
        f"ansible-playbook is neither beside {sys.executable} nor on PATH: install ansible-core in this environment"
    )


def _root(root: Optional[Path]) -> Path:
    try:
        return Path(root).absolute() if root else project_root()
    except RuntimeError as exc:
        raise SlurmMultiError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------------------
# Extra vars: data, never templates


def mark_unsafe(value: Any) -> Any:
    """``value`` with every string wrapped as ``{"__ansible_unsafe": string}``: Ansible reads it, never templates it."""
    if isinstance(value, str):
        return {UNSAFE_MARKER: value}
    if isinstance(value, Mapping):
        return {str(key): mark_unsafe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_unsafe(item) for item in value]
    return value


def unmark_unsafe(value: Any) -> Any:
    """The inverse of `mark_unsafe`."""
    if isinstance(value, Mapping):
        if set(value) == {UNSAFE_MARKER}:
            return value[UNSAFE_MARKER]
        return {key: unmark_unsafe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unmark_unsafe(item) for item in value]
    return value


def _write_private_json(path: Path, data: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def write_job_vars(path: Path, job_vars: Mapping[str, Any]) -> None:
    """Write the job's extra vars to a new 0600 JSON file, every string marked unsafe."""
    _write_private_json(Path(path), mark_unsafe(dict(job_vars)))


def read_job_vars(path: Path) -> Dict[str, Any]:
    """The job's extra vars as plain values."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SlurmMultiError(f"cannot read the job's vars file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SlurmMultiError(f"the job's vars file {path} does not hold a JSON object")
    return unmark_unsafe(data)


# ---------------------------------------------------------------------------------------------------------------
# What to run


@dataclass(frozen=True)
class JobSpec:
    """What the pipeline runs and where its results go: the group_vars the user overrides."""

    tags: tuple
    results_dir: Path
    models_file: Optional[Path] = None
    additional_context: Dict[str, Any] = field(default_factory=dict)
    registry: Optional[str] = None
    manifest_path: Optional[Path] = None
    extra_vars: Dict[str, Any] = field(default_factory=dict)

    def job_vars(self, secrets_file: Optional[Path] = None) -> Dict[str, Any]:
        """The extra vars (group_vars names) of this job; unset options keep group_vars' defaults."""
        job_vars = dict(self.extra_vars)
        job_vars.update(
            results_dir=str(self.results_dir),
            model_tags=list(self.tags),
            additional_context=self.additional_context,
        )
        optional = {"models_file": self.models_file, "registry": self.registry, "manifest_path": self.manifest_path,
                    "secrets_file": secrets_file}
        job_vars.update({name: str(value) for name, value in optional.items() if value})
        return job_vars


def _tag_list(tags: Union[str, Sequence[str]]) -> tuple:
    items = [tags] if isinstance(tags, str) else list(tags or [])
    split = tuple(tag.strip() for item in items for tag in str(item).split(",") if tag.strip())
    if not split:
        raise SlurmMultiError("no model tags given: name the model to run, e.g. --tags dummy")
    return split


def _existing_file(path: Union[str, Path], what: str) -> Path:
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise SlurmMultiError(f"{what} {path} does not exist or is not a file")
    return path


def _check_one_model(models_file: Path, tags: Sequence[str]) -> None:
    cards = select_model_cards(load_model_cards(models_file), list(tags))
    if len(cards) != 1:
        names = ", ".join(card["name"] for card in cards)
        raise SlurmMultiError(
            f"--tags {','.join(tags)} selects {len(cards)} models ({names}) but a multi-node job runs one model: "
            "narrow the tags to one model name"
        )


def job_spec(
    tags: Union[str, Sequence[str]],
    *,
    results_dir: Optional[Union[str, Path]] = None,
    models_file: Optional[Union[str, Path]] = None,
    additional_context: Optional[Union[str, Mapping[str, Any]]] = None,
    additional_context_file: Optional[Union[str, Path]] = None,
    registry: Optional[str] = None,
    manifest_path: Optional[Union[str, Path]] = None,
    extra_vars: Optional[Mapping[str, Any]] = None,
    root: Optional[Path] = None,
) -> JobSpec:
    """Check the user's input and make it a JobSpec.

    ``additional_context`` is MAD's ``-c`` (JSON text, MAD's Python-dict form, or a dict), merged recursively over
    ``additional_context_file``; invalid text is refused with the position of the error. ``registry`` is
    normalized (``ns/repo`` -> ``docker.io/ns/repo``), a malformed one refused. Without a manifest, the tags must
    select exactly one model of the models file. Relative paths are made absolute against the current directory.
    Results go to ``results_dir``, else MAD's ``slurm.results_dir`` from the context, else `default_results_dir`.
    """
    try:
        context: Dict[str, Any] = {}
        if additional_context_file:
            context = read_additional_context_file(additional_context_file)
        if additional_context:
            context = deep_merge(context, parse_additional_context(additional_context))
        _refuse_secret_literals(context)
        if isinstance(context.get("docker_build_arg"), dict):
            check_build_args(context["docker_build_arg"])  # Docker records build args in the image: no secrets
        normalized_registry = normalize_registry(registry) if registry is not None else None
        tag_list = _tag_list(tags)
        models = _existing_file(models_file, "the models file") if models_file else None
        manifest = _existing_file(manifest_path, "the build manifest") if manifest_path else None
        if manifest is None:
            default_models = _root(root) / "models" / "models.json"
            if models or default_models.is_file():
                _check_one_model(models or default_models, tag_list)
    except _INPUT_ERRORS as exc:
        raise SlurmMultiError(str(exc)) from None
    mad_slurm = context.get("slurm") if isinstance(context.get("slurm"), dict) else {}
    chosen_results_dir = results_dir or mad_slurm.get("results_dir") or default_results_dir()
    return JobSpec(
        tags=tag_list,
        results_dir=Path(chosen_results_dir).expanduser().absolute(),
        models_file=models,
        additional_context=context,
        registry=normalized_registry,
        manifest_path=manifest,
        extra_vars=dict(extra_vars or {}),
    )


def _refuse_secret_literals(context: Mapping[str, Any]) -> None:
    """A secret written into the context would sit in argv, the job's vars file and the dry-run output."""
    literals = secret_literals(context)
    if literals:
        names = sorted({path.rsplit(".", 1)[-1] for path in literals})
        raise SlurmMultiError(
            f"the additional context gives {', '.join(literals)} a literal value: a secret there would sit in argv, "
            "the job's vars and the dry-run output. Export it instead (export "
            f"{names[0]}=...; slurm-multi passes MAD_SECRETS_* of your environment to the containers alone) and "
            f"drop it from the context, or refer to it as \"${{{names[0]}}}\""
        )


def _user_secrets() -> Dict[str, str]:
    """The ``MAD_SECRETS_*`` of this process's environment, refused when the secrets file cannot carry one."""
    secrets, _ = split_secrets(os.environ)
    try:
        secrets_file_text(secrets)
    except SecretsError as exc:
        raise SlurmMultiError(str(exc)) from None
    return secrets


def slurm_options(nodes: Optional[int] = None, *, context: Optional[Mapping[str, Any]] = None,
                  **options: Any) -> SlurmOptions:
    """The job's SLURM request: the options given (None: not given) over MAD's ``slurm`` section of ``context``.

    MAD's additional context may carry ``{"slurm": {"partition": ..., "nodes": 2, "gpus_per_node": 8, "time":
    ..., "exclusive": true, ...}}``; its other keys (``output_dir``, ``modules``...) have no meaning here.
    """
    mad_slurm = (context or {}).get("slurm")
    merged = {key: mad_slurm[key] for key in MAD_SLURM_KEYS if key in mad_slurm} if isinstance(mad_slurm, dict) else {}
    if nodes is not None:
        merged["nodes"] = nodes
    merged.update({key: value for key, value in options.items() if value is not None})
    if "nodes" not in merged:
        raise SlurmMultiError("the node count is missing: give --nodes N (or slurm.nodes in the additional context)")
    if isinstance(merged["nodes"], str) and merged["nodes"].strip().isdigit():
        merged["nodes"] = int(merged["nodes"])
    if merged.get("gpus_per_node") is not None:
        merged["gpus_per_node"] = str(merged["gpus_per_node"])
    try:
        return SlurmOptions(**merged).validated()
    except (SbatchError, TypeError) as exc:
        raise SlurmMultiError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------------------
# Results


@dataclass
class RunResult:
    """A job's outcome: its verdict, each node's verdict, the perf rows and where its artifacts are.

    ``recorded`` is False when the job (or the attempt asked for) left no record (an infrastructure failure: the
    reason says why); ``rc`` is the pipeline's exit code (0 only on SUCCESS). SLURM keeps a requeued job's ID:
    ``attempt`` is the attempt this result is of (SLURM_RESTART_COUNT), ``attempts`` summarizes every recorded one.
    """

    job_id: str
    status: str
    reason: str
    rc: int
    per_node: Dict[str, Dict[str, Any]]
    perf: pd.DataFrame
    results_dir: Path
    job_dir: Path
    record_json: Optional[Path]
    record_csv: Optional[Path]
    recorded: bool
    metric_source: str = ""
    attempt: int = 0
    attempts: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def attempt_dir(self) -> Path:
        """This attempt's results: ``<job_dir>/attempt-<N>/`` (nodes' logs, status files, diagnostics)."""
        return Path(job_layout.attempt_dir(str(self.results_dir), self.job_id, self.attempt))


def job_result(results_dir: Union[str, Path], job_id: str, rc: Optional[int] = None,
               missing_reason: str = "the job left no record", attempt: Optional[int] = None) -> RunResult:
    """The result of a job from its record in ``results_dir`` (a FAILURE, not recorded, when there is none).

    With ``attempt``, that attempt must have its own record: an earlier attempt's does not stand for it.
    """
    results_dir = Path(results_dir).absolute()
    try:
        record = load_record(str(results_dir), job_id)
        json_path = Path(record_path(str(results_dir), job_id))
        if attempt is not None and load_record(str(results_dir), job_id, attempt) is None:
            record = None
    except ResultsCollectionError as exc:
        raise SlurmMultiError(str(exc)) from None
    if record is None:
        return RunResult(job_id, FAILURE, missing_reason, 2 if rc is None else rc, {}, pd.DataFrame(), results_dir,
                         results_dir / job_id, None, None, False, attempt=attempt or 0)
    status = record.get("status", FAILURE)
    csv_path = json_path.with_suffix(".csv")
    return RunResult(
        job_id=job_id,
        status=status,
        reason=record.get("reason", ""),
        rc=(0 if status == SUCCESS else 1) if rc is None else rc,
        per_node=record.get("per_node") or {},
        perf=pd.DataFrame.from_records(record.get("rows") or []),
        results_dir=results_dir,
        job_dir=results_dir / job_id,
        record_json=json_path,
        record_csv=csv_path if csv_path.is_file() else None,
        recorded=True,
        metric_source=record.get("metric_source", ""),
        attempt=int(record.get("attempt") or 0),
        attempts=list(record.get("attempts") or []),
    )


# ---------------------------------------------------------------------------------------------------------------
# Running the playbooks through ansible-runner


def _ansible_env(root: Path) -> Dict[str, str]:
    # This interpreter's scripts first: ansible-playbook of the same environment as the package.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {"ANSIBLE_CONFIG": str(root / "ansible.cfg"), "PATH": path, "ANSIBLE_FORCE_COLOR": "0"}


def run_playbook(
    playbook: str,
    job_vars: Mapping[str, Any],
    *,
    forks: Optional[int] = None,
    on_event: Optional[Callable[[dict], None]] = None,
    cancel: Optional[Callable[[], bool]] = None,
    root: Optional[Path] = None,
    quiet: bool = True,
) -> int:
    """Run ``playbooks/<playbook>`` with ``job_vars`` as unsafe extra vars; return ansible-playbook's exit code.

    ansible-runner works in a fresh 0700 private data dir that is removed afterwards. Its environment is this
    process's without ``MAD_SECRETS_*`` (the copy ansible-runner keeps in its artifacts included). ``on_event``
    receives each ansible-runner event; ``cancel`` is polled and stops the run when it returns True.
    """
    from ansible_runner import Runner, RunnerConfig

    root = _root(root)
    private_data_dir = Path(tempfile.mkdtemp(prefix="slurm-multi-runner-"))
    try:
        (private_data_dir / "env").mkdir(mode=0o700)
        write_job_vars(private_data_dir / "env" / "extravars", job_vars)
        config = RunnerConfig(
            private_data_dir=str(private_data_dir),
            playbook=str(root / "playbooks" / playbook),
            project_dir=str(root),
            forks=forks,
            envvars=_ansible_env(root),
            quiet=quiet,
        )
        config.prepare()
        config.env = without_secrets(config.env)

        def handle_event(event: dict) -> bool:
            if on_event is not None:
                on_event(event)
            return False  # nothing to keep: the private data dir goes when the run ends

        stopping = []

        def stop_gently() -> bool:
            # ansible-runner's own cancel SIGKILLs ansible-playbook's process group, which leaves the model
            # containers running: TERM it instead, so that the run module snapshots diagnostics and stops them.
            if cancel is not None and not stopping and cancel():
                stopping.append(True)
                _terminate_playbook_of(private_data_dir)
            return False

        runner = Runner(config=config, event_handler=handle_event, cancel_callback=stop_gently)
        runner.run()
        return runner.rc if runner.rc is not None else 2
    finally:
        shutil.rmtree(private_data_dir, ignore_errors=True)


def _terminate_playbook_of(private_data_dir: Path) -> None:
    """SIGTERM to the process group of the ansible-playbook that ansible-runner started for this run.

    It is the child of this process whose command line names the run's own private data dir; any other child
    (the caller's own subprocesses) is left alone.
    """
    own_group = os.getpgrp()
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                group = os.getpgid(int(pid))
                if str(private_data_dir) in cmdline and group != own_group:
                    os.killpg(group, signal.SIGTERM)
            except (OSError, ProcessLookupError):
                continue


# collect.yml after the pipeline (or again later): its verdict is data here, so a non-zero exit means that
# collecting itself failed.
_COLLECT_ONLY = {"postprocessing_fail_on_failure": False}


def _allocation_nodes(environ: Mapping[str, str]) -> List[str]:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return []
    try:
        return expand_nodelist(nodelist)
    except AllocationError as exc:
        raise SlurmMultiError(str(exc)) from None


def run(
    spec: JobSpec,
    *,
    job_id: Optional[str] = None,
    forks: Optional[int] = None,
    on_event: Optional[Callable[[dict], None]] = None,
    cancel: Optional[Callable[[], bool]] = None,
    root: Optional[Path] = None,
    quiet: bool = True,
) -> RunResult:
    """Run the pipeline (run_multi.yml, then collect.yml whatever happened) in this allocation; return its result.

    Inside salloc/sbatch the inventory is the allocation and ``forks`` defaults to its node count; outside one
    it is a one-node run on localhost. ``job_id`` defaults to ``SLURM_JOB_ID`` (else ``local-<time>``); a job that
    already has a record is refused (give another ``job_id`` for a second run in the same allocation).
    ``MAD_SECRETS_*`` of the environment reach the nodes through a 0600 file that is removed after the run.
    """
    root = _root(root)
    nodes = _allocation_nodes(os.environ)
    try:
        job_id = validate_job_id(
            job_id or os.environ.get("SLURM_JOB_ID") or f"local-{time.strftime('%Y%m%d%H%M%S')}-{token_hex(2)}"
        )
        # A requeued job keeps its ID: this run is its attempt SLURM_RESTART_COUNT, recorded on its own.
        attempt = job_layout.attempt_from_env(os.environ)
        existing = load_record(str(spec.results_dir), job_id, attempt)
    except ResultsCollectionError as exc:
        raise SlurmMultiError(str(exc)) from None
    if existing is not None:
        raise SlurmMultiError(
            f"job {job_id} attempt {attempt} already has a record "
            f"({record_path(str(spec.results_dir), job_id, attempt)}): its results are final. For another run "
            f"in the same allocation give it its own ID, e.g. --job-id {job_id}.2"
        )
    user_secrets = _user_secrets()
    private_dir = _new_private_dir() if user_secrets else None
    try:
        secrets_file = write_secrets_file(private_dir, user_secrets) if private_dir else None
        job_vars = spec.job_vars(secrets_file)
        rc = run_playbook("run_multi.yml", dict(job_vars, job_id=job_id), forks=forks or max(len(nodes), 1),
                          on_event=on_event, cancel=cancel, root=root, quiet=quiet)
        # The pipeline's own postprocessing wrote the record unless the run was cut short: collect only then.
        if load_record(str(spec.results_dir), job_id, attempt) is None:
            run_playbook("collect.yml", dict(job_vars, collect_job_id=job_id, collect_attempt=attempt,
                                             collect_nodes=nodes, **_COLLECT_ONLY),
                         on_event=on_event, root=root, quiet=quiet)
    except SecretsError as exc:
        raise SlurmMultiError(str(exc)) from None
    finally:
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)
    return job_result(spec.results_dir, job_id, rc, attempt=attempt, missing_reason=(
        f"the pipeline ended (exit code {rc}) without writing the job's record; its output above says why"))


def collect(
    job_id: str,
    results_dir: Optional[Union[str, Path]] = None,
    *,
    attempt: Optional[int] = None,
    on_event: Optional[Callable[[dict], None]] = None,
    root: Optional[Path] = None,
    quiet: bool = True,
) -> RunResult:
    """Re-run postprocessing (collect.yml) for a job's attempt; its record, once written, stays as it is.

    ``attempt`` (SLURM_RESTART_COUNT of the run) defaults to the job's last attempt on disk.
    """
    results_dir = Path(results_dir or default_results_dir()).expanduser().absolute()
    try:
        job_id = validate_job_id(job_id)
        attempt = (job_layout.latest_attempt(str(results_dir), job_id) if attempt is None
                   else job_layout.validate_attempt(attempt))
    except ResultsCollectionError as exc:
        raise SlurmMultiError(str(exc)) from None
    if not (results_dir / job_id).is_dir() and load_record(str(results_dir), job_id) is None:
        raise SlurmMultiError(
            f"job {job_id} has neither results ({results_dir / job_id}) nor a record in {results_dir}")
    rc = run_playbook("collect.yml", {"results_dir": str(results_dir), "collect_job_id": job_id,
                                      "collect_attempt": attempt, "collect_nodes": [], **_COLLECT_ONLY},
                      on_event=on_event, root=root, quiet=quiet)
    return job_result(results_dir, job_id, attempt=attempt,
                      missing_reason=f"collect.yml ended (exit code {rc}) without a record")


# ---------------------------------------------------------------------------------------------------------------
# Submitting


@dataclass(frozen=True)
class SubmissionPlan:
    """What `submit` would write and queue (``--dry-run`` shows it): nothing exists yet."""

    private_dir: Path
    job_script: str
    collect_script: str
    job_vars: Dict[str, Any]
    secret_names: tuple

    @property
    def vars_file(self) -> Path:
        """Where the job's vars file would be written."""
        return self.private_dir / VARS_FILE_NAME


@dataclass(frozen=True)
class Submission:
    """A submitted job and its afterany collect job."""

    job_id: str
    collect_job_id: str
    results_dir: Path
    private_dir: Path

    @property
    def job_dir(self) -> Path:
        """The job's results: ``<results_dir>/<job_id>/`` (nodes' logs, status files, diagnostics)."""
        return self.results_dir / self.job_id

    @property
    def output(self) -> Path:
        """The job's output file: the pipeline's Ansible output."""
        return sbatch.job_output_path(self.private_dir, self.job_id)

    @property
    def vars_file(self) -> Path:
        """The job's extra vars (strings marked unsafe)."""
        return self.private_dir / VARS_FILE_NAME


def plan_submission(spec: JobSpec, slurm: SlurmOptions, *, root: Optional[Path] = None,
                    private_dir: Optional[Path] = None) -> SubmissionPlan:
    """Render the job's scripts and vars without writing or submitting anything."""
    root = _root(root)
    private_dir = Path(private_dir) if private_dir else private_jobs_dir() / "<submission>"
    user_secrets = _user_secrets()
    secrets_file = private_dir / "secrets.env" if user_secrets else None
    vars_file = private_dir / VARS_FILE_NAME
    try:
        job_script = sbatch.render_job_script(slurm, root, find_ansible_playbook(), vars_file, private_dir)
        collect_script = sbatch.render_collect_script(slurm, JOB_ID_PLACEHOLDER, Path(sys.executable), vars_file,
                                                      private_dir)
    except SbatchError as exc:
        raise SlurmMultiError(str(exc)) from None
    return SubmissionPlan(private_dir, job_script, collect_script, spec.job_vars(secrets_file),
                          tuple(sorted(user_secrets)))


def submit(spec: JobSpec, slurm: SlurmOptions, *, root: Optional[Path] = None) -> Submission:
    """Submit the job and its afterany collect job; return both IDs.

    Writes the job's private dir (0700: scripts, vars file, 0600 secrets file) under `private_jobs_dir`; sbatch
    gets this process's environment without ``MAD_SECRETS_*``. The job is queued held until its collect job is
    queued too, so that no job runs without the job that records it.
    """
    root = _root(root)
    user_secrets = _user_secrets()
    environment = without_secrets(os.environ)
    private_dir = _new_private_dir()
    secrets_file, job_id = None, None
    try:
        secrets_file = write_secrets_file(private_dir, user_secrets) if user_secrets else None
        vars_file = private_dir / VARS_FILE_NAME
        write_job_vars(vars_file, spec.job_vars(secrets_file))
        job_script = private_dir / JOB_SCRIPT_NAME
        job_script.write_text(sbatch.render_job_script(slurm, root, find_ansible_playbook(), vars_file, private_dir))
        job_id = sbatch.submit_script(job_script, environment, cwd=private_dir, hold=True)
        collect_script = private_dir / COLLECT_SCRIPT_NAME
        collect_script.write_text(
            sbatch.render_collect_script(slurm, job_id, Path(sys.executable), vars_file, private_dir))
        collect_job_id = sbatch.submit_script(collect_script, environment, cwd=private_dir)
        sbatch.release_job(job_id)
    except BaseException as exc:
        # Whatever failed (sbatch refused, a template error, Ctrl-C), no job will read the secrets: they go now.
        # Nothing queued: the whole private dir goes. A job queued held: it is cancelled, its scripts stay.
        cancelled = ""
        if job_id is None:
            shutil.rmtree(private_dir, ignore_errors=True)
        else:
            if secrets_file:
                secrets_file.unlink(missing_ok=True)
            try:
                sbatch.cancel_job(job_id)
                cancelled = f"; job {job_id} was cancelled before it started"
            except SbatchError as cancel_error:
                cancelled = f"; job {job_id} is held and could not be cancelled ({cancel_error}): scancel it"
        if isinstance(exc, SbatchError):
            raise SlurmMultiError(f"{exc}{cancelled}") from None
        raise
    submission = Submission(job_id, collect_job_id, spec.results_dir, private_dir)
    (private_dir / SUBMISSION_FILE_NAME).write_text(json.dumps(
        {"job_id": job_id, "collect_job_id": collect_job_id, "results_dir": str(spec.results_dir),
         "output": str(submission.output)}, indent=2) + "\n")
    return submission


# ---------------------------------------------------------------------------------------------------------------
# Following a submitted job


def _job_info(job_id: str) -> Optional[Dict[str, str]]:
    try:
        return sbatch.job_info(job_id)
    except SbatchError as exc:
        raise SlurmMultiError(f"{exc}; job {job_id} itself is not affected") from None


def _state(info: Optional[Mapping[str, str]]) -> Optional[str]:
    return info.get("JobState") if info else None


def _attempt(info: Optional[Mapping[str, str]]) -> Optional[int]:
    """The job's current attempt from SLURM (``Restarts``: how often it was requeued); None once SLURM forgot it."""
    restarts = (info or {}).get("Restarts", "")
    return int(restarts) if restarts.isdigit() else None


def _exit_code(info: Optional[Mapping[str, str]]) -> Optional[int]:
    try:
        return int((info or {}).get("ExitCode", "").split(":", 1)[0])
    except ValueError:
        return None


class _OutputFollower:
    """Reads the complete lines a growing file gained since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self) -> List[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [line.decode("utf-8", "replace") for line in lines]


def _node_status_line(node: str, status: Mapping[str, Any]) -> str:
    verdict = status.get("status", "?")
    details = [f"exit {status.get('exit_code')}"] if status.get("exit_code") is not None else []
    details.append(f"{status.get('perf_lines', 0)} performance line(s)")
    if status.get("reason"):
        details.append(str(status["reason"]))
    return f"{node}: {verdict} ({'; '.join(details)})"


def wait(submission: Submission, *, on_progress: Callable[[str], None] = print,
         poll_interval: float = 2.0) -> RunResult:
    """Follow a submitted job until it is recorded; report progress lines; return its result.

    Progress: SLURM's job state, one line per finished pipeline task with each node's outcome, each node's
    verdict as its status.json appears. Ends when the job has ended and its last attempt's record exists (SLURM
    keeps a requeued job's ID; ``Restarts`` counts its attempts), or when the collect job has ended without one
    (an unrecorded result: ``recorded`` False).
    """
    progress = PipelineProgress(on_progress)
    output = _OutputFollower(submission.output)
    seen_statuses: set = set()
    last_state = None
    while True:
        info = _job_info(submission.job_id)
        state = _state(info)
        if state and state != last_state:
            where = f" on {info.get('NodeList')}" if state == "RUNNING" else ""
            why = f" ({info.get('Reason')})" if info.get("Reason") not in (None, "None") else ""
            on_progress(f"job {submission.job_id}: {state}{where}{why}")
            last_state = state
        for line in output.new_lines():
            progress.feed_output_line(line)
        attempt = _attempt(info)
        attempt_dir = Path(job_layout.attempt_dir(str(submission.results_dir), submission.job_id, attempt or 0))
        for status_file in sorted(attempt_dir.glob("nodes/*/status.json")):
            if status_file in seen_statuses:
                continue
            try:
                status = json.loads(status_file.read_text())
            except (OSError, ValueError):
                continue  # written by rename: a partial read only happens on a file being replaced
            seen_statuses.add(status_file)
            progress.task_finished()
            on_progress(_node_status_line(status_file.parent.name, status))
        job_over = state not in ACTIVE_JOB_STATES
        # The last attempt's own record: a requeued job's earlier record does not stand for its last run.
        record_file = Path(record_path(str(submission.results_dir), submission.job_id, attempt or 0))
        if job_over and record_file.is_file():
            break
        if job_over and _state(_job_info(submission.collect_job_id)) not in ACTIVE_JOB_STATES:
            break
        time.sleep(poll_interval)
    for line in output.new_lines():
        progress.feed_output_line(line)
    progress.task_finished()
    missing_reason = (f"job {submission.job_id} ended ({state or 'state unknown'}) and its collect job "
                      f"{submission.collect_job_id} wrote no record for attempt {attempt or 0}: see "
                      f"{submission.private_dir}/collect-*.out")
    return job_result(submission.results_dir, submission.job_id, _exit_code(info), missing_reason, attempt=attempt)


# ---------------------------------------------------------------------------------------------------------------
# The afterany collect job


def _model_card(job_vars: Mapping[str, Any], root: Path) -> Dict[str, Any]:
    tags = list(job_vars.get("model_tags") or [])
    models_file = job_vars.get("models_file") or str(root / "models" / "models.json")
    try:
        cards = select_model_cards(load_model_cards(models_file), tags)
    except (ManifestError, OSError, ValueError):
        cards = []
    return dict(cards[0]) if len(cards) == 1 else {"name": ",".join(tags)}


def record_job_end(job_id: str, vars_file: Union[str, Path], *, root: Optional[Path] = None) -> RunResult:
    """What the afterany collect job does once job ``job_id`` has ended, whatever its end.

    When the job left no record, writes a FAILURE record with SLURM's own view (``JobState``: CANCELLED,
    TIMEOUT, NODE_FAIL, ...; its ``Reason``), keeping whatever its nodes left as evidence; then regenerates
    perf.csv and removes the job's secrets file, which nothing needs any more.
    """
    root = _root(root)
    job_vars = read_job_vars(Path(vars_file))
    results_dir = str(Path(job_vars.get("results_dir") or default_results_dir()))
    try:
        job_id = validate_job_id(job_id)
        info = sbatch.job_info(job_id)
        state = _state(info)
        if state in ACTIVE_JOB_STATES:
            raise SlurmMultiError(f"job {job_id} is still {state}: record its end after it has ended")
        _forget_secrets(job_vars, Path(vars_file))
        # SLURM keeps a requeued job's ID: record its last attempt (Restarts), else the last one on disk.
        attempt = _attempt(info)
        if attempt is None:
            attempt = job_layout.latest_attempt(results_dir, job_id)
        if load_record(results_dir, job_id, attempt) is None:
            nodelist = (info or {}).get("NodeList", "")
            nodes = expand_nodelist(nodelist) if nodelist and not nodelist.startswith("(") else []
            slurm_reason = (info or {}).get("Reason", "None")
            reason = "the job ended without writing its record"
            if slurm_reason not in ("", "None"):
                reason += f"; SLURM's reason: {slurm_reason}"
            write_failure_record(results_dir, job_id, reason, slurm_state=state or "UNKNOWN (SLURM forgot the job)",
                                 model=_model_card(job_vars, root), nodes=nodes, attempt=attempt)
        regenerate_perf_csv(results_dir)
    except _INPUT_ERRORS as exc:
        raise SlurmMultiError(str(exc)) from None
    return job_result(results_dir, job_id, _exit_code(info), attempt=attempt)


def _forget_secrets(job_vars: Mapping[str, Any], vars_file: Path) -> None:
    """Remove the ended job's secrets file (only the one in the job's own private dir)."""
    secrets_file = job_vars.get("secrets_file")
    if secrets_file and Path(secrets_file).parent == vars_file.parent:
        Path(secrets_file).unlink(missing_ok=True)
