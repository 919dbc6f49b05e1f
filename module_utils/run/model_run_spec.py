"""What one node's model run is: its options (`ModelRun`), their checks, and the ``docker run`` argv and environment,
decided before anything starts (`plan_model_run`); no ``--rm``, so a failed container can be snapshotted."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import docker_argv
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import (
    allocated_gpu_indices,
    docker_gpu_args,
    gpu_env,
    select_gpus,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import (
    expand_placeholders,
    is_secret_name,
    placeholder_names,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.model_card_fields import ALL_GPUS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import (
    SecretsError,
    check_secret_value,
    format_env_file,
    mask_secrets,
    read_secrets_file,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import (
    LABEL_PREFIX,
    current_user,
    owner_labels,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run import container_command as marks
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import DEFAULT_LOG_DIRS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.docker_mounts import mount_args
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import (
    LAUNCHER_FILES_DIR,
    MADENGINE_GUEST_OS,
    LauncherEnvironment,
    LauncherError,
    LaunchSite,
    distributed_from_dict,
    launcher_environment,
    madengine_environment,
    node_addresses_in_rank_order,
    route_interface,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_data import missing_data_paths
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import DEFAULT_ERROR_PATTERNS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import (
    RUN_DIRECTORY,
    AppliedTools,
    ToolsError,
    apply_tools,
    known_tools,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import routable_addresses
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

WORKSPACE = "/myworkspace"
DIAGNOSTICS_BUDGET = 15.0
# RDMA's verbs devices: NCCL/RCCL over InfiniBand or RoCE need them in the container, and memory they may pin.
INFINIBAND_DEVICES = "/dev/infiniband"

# Docker's rule for container names: the job ID must fit it too (the job layout allows a '+').
_CONTAINER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]+$")


class ModelRunError(UserError):
    """An infrastructure failure or bad input: the task must fail (a model failure is not one)."""


@dataclass
class ModelRun:
    """Everything one node's run needs; the fields are the run module's options (library/run_model.py documents
    them)."""

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
    attempt: int = 0
    user: str = field(default_factory=lambda: current_user())
    model_args: Union[str, Sequence[str]] = ""
    docker_env_vars: Mapping[str, object] = field(default_factory=dict)
    docker_mounts: Mapping[str, str] = field(default_factory=dict)
    # The card's data as `host:container[:mode]` binds (module_utils/run/model_data.py): the same list for any runtime.
    data_mounts: Sequence[str] = ()
    additional_docker_run_options: Union[str, Sequence[str]] = ""
    gpu_vendor: Optional[str] = None
    gpus: Sequence[Mapping[str, object]] = ()
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    timeout: Optional[float] = None
    job_end_time: Optional[float] = None
    end_margin: float = 120.0
    error_patterns: Sequence[str] = DEFAULT_ERROR_PATTERNS
    multiple_results: Optional[str] = None
    n_gpus: int = ALL_GPUS
    skip_gpu_arch: Sequence[str] = ()
    secrets_file: Optional[str] = None
    stop_grace: int = 10
    poll_interval: float = 0.5
    diagnostics_log_dirs: Sequence[str] = DEFAULT_LOG_DIRS
    diagnostics_budget: float = DIAGNOSTICS_BUDGET
    steps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # The model's `distributed` section, checked on the controller (launchers.Distributed.as_dict); empty: none.
    distributed: Mapping[str, object] = field(default_factory=dict)
    allocation_nodes: Sequence[str] = ()
    node_addresses: Mapping[str, str] = field(default_factory=dict)
    provenance: Mapping[str, str] = field(default_factory=dict)
    guest_os: str = MADENGINE_GUEST_OS
    hang_timeout: float = 0.0
    tools: Sequence[Mapping[str, object]] = ()
    tools_file: Optional[str] = None
    # The dry run's plan on the login node: what only the node knows (its GPUs, devices, routes) becomes a mark
    # (module_utils/run/container_command.py) instead of a value.
    on_login_node: bool = False

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


def container_name(job_id: str, rank: int) -> str:
    """``slurm-multi-<job_id>-r<rank>``."""
    return f"{LABEL_PREFIX}-{job_id}-r{rank}"


def container_labels(job_id: str, rank: int, user: str, model: str, environ: Mapping[str, str]) -> Dict[str, str]:
    """The labels naming a job's container and its owner, this process (``environ``: the run's, its SLURM_JOB_ID)."""
    return {
        f"{LABEL_PREFIX}.job": str(job_id),
        f"{LABEL_PREFIX}.rank": str(rank),
        f"{LABEL_PREFIX}.user": user,
        f"{LABEL_PREFIX}.model": model,
        **owner_labels(environ),
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


# madengine runs a .sh script with bash (`bash run.sh`): MAD's scripts use $RANDOM, arrays, [[ ]], source and
# pipefail, which dash, the /bin/sh of Debian and Ubuntu bases, lacks. A base without bash (busybox) runs it under
# sh, saying so in the log. The image's name ($0), the script ($1) and its args stay argv, never shell code.
_BASH_ELSE_SH = (
    'if command -v bash >/dev/null 2>&1; then exec bash "$@"; fi; '
    "printf 'slurm-multi: image %s has no bash; running %s under sh (madengine runs a .sh script with bash)\\n' "
    '"$0" "$1" >&2; '
    'exec sh "$@"'
)


def model_command(script: str, model_args: Union[str, Sequence[str]] = "", image: str = "") -> List[str]:
    """The argv the container runs, as madengine runs a card's script: ``.sh``/``.slurm`` under bash (else sh, with a
    warning naming ``image``), ``.py`` under python3, anything else the script itself."""
    args = split_options(model_args, "model_args")
    if script.endswith((".sh", ".slurm")):
        return ["sh", "-c", _BASH_ELSE_SH, image or "(unnamed)", script, *args]
    if script.endswith(".py"):
        return ["python3", script, *args]
    return [f"./{script}" if "/" not in script else script, *args]


def inside_model_dir(base: str, relative: str, what: str) -> str:
    """``base/relative``, refusing absolute paths and paths that leave ``base``."""
    if os.path.isabs(relative):
        raise ModelRunError(f"{what} {relative!r} must be relative to the model dir {base}")
    path = os.path.realpath(os.path.join(base, relative))
    if os.path.commonpath([path, os.path.realpath(base)]) != os.path.realpath(base):
        raise ModelRunError(f"{what} {relative!r} leaves the model dir {base}")
    return path


def validate(run: ModelRun) -> None:
    """Refuse input that would break names, paths or the run, with a message saying what to fix."""
    try:
        # The job ID, attempt and node name by the job layout's rules: they name the node's files.
        job_layout.node_dir(run.results_dir, run.job_id, run.attempt, run.node)
    except job_layout.JobLayoutError as err:
        raise ModelRunError(str(err)) from None
    if not _CONTAINER_NAME.match(run.container):
        raise ModelRunError(
            f"job_id {run.job_id!r} cannot name a container ({run.container}): Docker allows letters, digits, "
            "'_', '.' and '-' only; run it under another job ID (a heterogeneous job's '+' is not allowed)"
        )
    if run.nnodes < 1 or not 0 <= run.rank < run.nnodes:
        raise ModelRunError(f"rank {run.rank} is not in 0..{run.nnodes - 1} (nnodes={run.nnodes})")
    if not os.path.isdir(run.model_dir):
        raise ModelRunError(f"model_dir {run.model_dir} is not a directory on {run.node}")
    if not run.script:
        raise ModelRunError("script is empty: give the model's script, relative to the model dir")
    if not os.path.isfile(inside_model_dir(run.model_dir, run.script, "script")):
        raise ModelRunError(f"script {run.script} not found in the model dir {run.model_dir}")
    if run.multiple_results:
        inside_model_dir(run.model_dir, run.multiple_results, "multiple_results")
    if "--rm" in split_options(run.additional_docker_run_options, "additional_docker_run_options"):
        raise ModelRunError(
            "additional_docker_run_options holds --rm: remove it; slurm-multi removes its containers itself, "
            "after taking diagnostics of a failed one"
        )
    split_options(run.model_args, "model_args")  # an unbalanced quote fails here, before anything starts
    missing = missing_data_paths(list(run.data_mounts))
    if missing:
        raise ModelRunError(
            f"model {run.model}: its data's local path {', '.join(missing)} does not exist on {run.node}: put the "
            "data on storage every node sees, or fix the path in data.json"
        )
    run_tools(run)
    try:
        distributed_from_dict(run.distributed, run.nnodes)
    except LauncherError as err:
        raise ModelRunError(f"model {run.model}: {err}") from None


def run_tools(run: ModelRun) -> Tuple[Optional[AppliedTools], List[str]]:
    """The context's tools merged as madengine merges them (module_utils/run/tools.py) and their mounts; (None, [])
    without any."""
    if not run.tools:
        return None, []
    try:
        tools = apply_tools(run.tools, known_tools(run.tools_file), run.tools_file)
        return tools, tools.mounts(run.node_dir, run.tools_file)
    except ToolsError as err:
        raise ModelRunError(f"model {run.model} on {run.node}: {err}") from None


def run_launcher_environment(run: ModelRun) -> LauncherEnvironment:
    """The variables madengine gives every container on this node, with the model's launcher's over them."""
    distributed = distributed_from_dict(run.distributed, run.nnodes)
    addresses = []  # type: List[str]
    if distributed.launcher == "sglang-disagg" and not run.on_login_node:
        addresses, missing = node_addresses_in_rank_order(run.allocation_nodes, run.node_addresses, routable_addresses)
        if missing:
            raise ModelRunError(
                f"sglang-disagg gives every node's address, but {', '.join(missing)} resolve(s) to none that is not "
                f"loopback on {run.node}: set node_addresses in the site config (/etc/slurm-multi/site.yml)"
            )
    gpus = container_gpus(run)
    gpu_count = None if gpus is None else len(gpus)  # type: Optional[object]
    if run.on_login_node:
        gpu_count = marks.NODE_GPU_COUNT
        addresses = [run.node_addresses.get(node) or f"<address of {node}>" for node in run.allocation_nodes]
    site = LaunchSite(
        rank=run.rank,
        nnodes=run.nnodes,
        master_addr=run.master_addr,
        master_port=run.master_port,
        slurm_job_id=str(run.environ.get("SLURM_JOB_ID") or run.job_id),
        gpus=gpu_count,
        model=run.model,
        node_addresses=addresses,
        node_names=list(run.allocation_nodes),
        socket_ifname=marks.NODE_ROUTE_INTERFACE if run.on_login_node else route_interface(run.master_addr),
    )
    try:
        launch = launcher_environment(distributed, site)
    except LauncherError as err:
        raise ModelRunError(f"model {run.model}: {err}") from None
    every = madengine_environment(site, run.gpu_vendor, run.gpus, run.multiple_results, run.environ, run.guest_os)
    return LauncherEnvironment(
        dict(every.identity, **launch.identity), dict(every.defaults, **launch.defaults), launch.workspace_files
    )


def card_gpu_indices(run: ModelRun, indices: Optional[List[int]]) -> Optional[List[int]]:
    """The GPU indices the container gets: the allocation's (None: the node's all), the first ``n_gpus`` of them."""
    if run.n_gpus == ALL_GPUS:
        return indices
    available = [gpu["index"] for gpu in select_gpus(indices, list(run.gpus))]
    if run.n_gpus > len(available):
        raise ModelRunError(
            f"model {run.model} asks for n_gpus={run.n_gpus} per node, but {run.node} has {len(available)} GPU(s) "
            "allocated: request more GPUs per node (--gpus-per-node), or set the card's n_gpus to -1 (all allocated)"
        )
    return available[: run.n_gpus]


def container_gpus(run: ModelRun) -> Optional[List[Mapping[str, object]]]:
    """The GPUs the container gets on this node (their GPU facts); None: unknown (no vendor detected)."""
    if not run.gpu_vendor:
        return None
    if run.gpu_vendor.lower() == "none":
        return []
    try:
        return select_gpus(card_gpu_indices(run, allocated_gpu_indices(run.environ)), list(run.gpus))
    except ValueError as err:
        raise ModelRunError(f"cannot give the container its GPUs: {err}") from None


def gpu_architecture(gpus: Optional[Sequence[Mapping[str, object]]]) -> str:
    """The perf row's gpu_architecture: the first GPU's architecture (AMD's gfx942), else its name (NVIDIA's)."""
    first = (gpus or [{}])[0]
    return str(first.get("arch") or first.get("name") or "")


def docker_run_args(run: ModelRun, env_file: Optional[str], launch: Optional[LauncherEnvironment] = None) -> List[str]:
    """The ``docker`` arguments (``run ...``) for this node; ``env_file`` carries the user environment and secrets,
    ``launch`` the launcher's variables (`run_launcher_environment`)."""
    extra_options = split_options(run.additional_docker_run_options, "additional_docker_run_options")
    argv = ["run", "-d", "--init", "--name", run.container]
    labels = container_labels(run.job_id, run.rank, run.user, run.model, run.environ)
    if run.on_login_node:
        labels.update((key, marks.NODE_VALUE) for key in owner_labels(run.environ))  # the run module's process
    for key, value in labels.items():
        argv += ["--label", f"{key}={value}"]
    given = {option.split("=", 1)[0] for option in extra_options}
    if not given & {"--network", "--net"}:
        argv.append("--network=host")  # NCCL/RCCL and MASTER_ADDR need the node's own interfaces
    if not given & {"--ipc", "--shm-size"}:
        # The host's shared memory: NCCL/RCCL between a node's ranks, and DataLoader workers, outgrow Docker's 64 MB.
        argv.append("--ipc=host")
    tools, tool_mounts = run_tools(run)
    # With MAD's tools, madengine's layout: the model's dir is the run directory under MAD's root (tools.py).
    workdir = RUN_DIRECTORY if tools else WORKSPACE
    argv += ["--workdir", workdir]
    topology = {
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.master_port),
        "NNODES": str(run.nnodes),
        "NODE_RANK": str(run.rank),
    }
    gpu_arguments = []  # type: List[str]
    if run.on_login_node:
        gpu_arguments = [marks.NODE_GPUS]
    elif run.gpu_vendor:
        try:
            indices = card_gpu_indices(run, allocated_gpu_indices(run.environ))
            topology.update(gpu_env(run.gpu_vendor, indices))
            gpu_arguments = docker_gpu_args(run.gpu_vendor, indices, list(run.gpus))
        except ValueError as err:
            raise ModelRunError(f"cannot give the container its GPUs: {err}") from None
    launch = launch or run_launcher_environment(run)
    topology.update(launch.identity)
    tool_environment = tools.environment() if tools else {}
    user_names = {str(name) for name in (run.docker_env_vars or {})} | set(tool_environment)
    topology.update((name, value) for name, value in launch.defaults.items() if name not in user_names)
    # The docker CLI applies -e after --env-file: the topology wins over a docker_env_vars entry of that name
    # (a launcher's tunables were left out above where the user set them), the tools' over the user's, as in
    # madengine, but not over who and where the rank is.
    for name, value in tool_environment.items():
        if name not in topology:
            argv += ["-e", f"{name}={value}"]
    for name, value in topology.items():
        argv += ["-e", f"{name}={value}"]
    if env_file:
        argv += ["--env-file", env_file]
    argv += gpu_arguments + fabric_args(run, given)
    # The model dir goes first: where a context mount names the same target, the first one wins.
    mounts = {workdir: os.path.realpath(run.model_dir)}
    mounts.update((target, source) for target, source in (run.docker_mounts or {}).items() if target != workdir)
    # The launcher's files (deepspeed's hostfile), which the run writes in the node's dir (model_run.py).
    launcher_files = [
        f"{os.path.join(run.node_dir, name)}:{LAUNCHER_FILES_DIR}/{name}:ro" for name in launch.workspace_files
    ]
    try:
        argv += mount_args(mounts, extra_options)
        argv += mount_args(list(run.data_mounts) + launcher_files + tool_mounts, extra_options)
    except ValueError as err:
        raise ModelRunError(f"cannot mount into the container: {err}") from None
    argv += (tools.docker_options() if tools else []) + extra_options
    argv.append(run.image)
    image_name = run.provenance.get("docker_image") or run.image
    command = model_command(run.script, run.model_args, image_name)
    argv += tools.command(command, image_name) if tools else command
    return argv


def fabric_args(run: ModelRun, given: Set[str]) -> List[str]:
    """The node's InfiniBand devices (the whole directory: every HCA's uverbs and rdma_cm) and an unlimited memlock,
    which RDMA's memory registration needs, where the node has them; a ``--ulimit`` the user gave stands."""
    if run.on_login_node:
        return [marks.NODE_FABRIC]
    if not os.path.isdir(INFINIBAND_DEVICES):
        return []
    return ["--device", INFINIBAND_DEVICES] + ([] if "--ulimit" in given else ["--ulimit", "memlock=-1:-1"])


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

    A secret wins over a ``docker_env_vars`` entry of its name; a placeholder left can only name a secret: it gets its
    value, or is dropped with a warning, never passed literally. A secret too short to mask is refused (SecretsError).
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
            missing = ", ".join("${" + ref + "}" for ref in sorted(set(placeholder_names(value)) - set(secrets)))
            warnings.append(
                f"docker_env_vars: {name} left unset: nothing gives {missing} "
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


def run_environment(run: ModelRun) -> ContainerEnvironment:
    """The environment for the env file, checked to fit in one (names, no line breaks) before anything starts."""
    try:
        secrets = read_secrets_file(run.secrets_file) if run.secrets_file else {}
        environment = container_environment(run.docker_env_vars, secrets)
        format_env_file(environment.variables)
    except SecretsError as err:
        raise ModelRunError(str(err)) from None
    return environment


def plan_model_run(run: ModelRun, plan_argv=None) -> Dict[str, object]:
    """What a run would do (check mode; on the login node, ``run.on_login_node``, without the node's checks): the
    argv that starts the rank (``plan_argv(run, env file)``, a runtime's `ContainerRuntime.plan`; default Docker's),
    the container's variables, the command's record (`container_command.command_lines`), warnings."""
    if not run.on_login_node:
        validate(run)
    environment = run_environment(run)
    env_file = marks.ENV_FILE if environment.variables else None
    argv = plan_argv(run, env_file) if plan_argv else docker_argv(docker_run_args(run, env_file))
    return {
        "container": run.container,
        "docker_run_argv": [mask_secrets(arg, environment.secret_values) for arg in argv],
        "env_file_variables": sorted(environment.variables),
        "command_lines": marks.command_lines(argv, environment.variables, environment.secret_values),
        "warnings": environment.warnings,
    }
