"""The job's config: MAD's deployment_config (a `slurm` section and context keys) from each source, checked and
merged into one (`deep_merge`, lowest source first: docs/settings.md). No setting is silently ignored: unknown
`slurm` keys and near misses of known keys (`slrum`) are refused; keys starting with `_` are comments."""

from __future__ import annotations

import difflib
import re
from functools import reduce

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import (
    RunContextError,
    deep_merge,
    is_secret_name,
    parse_additional_context,
)

# The `slurm` keys that become the job's sbatch options (MAD's names), an `#SBATCH` line each.
SLURM_REQUEST_KEYS = (
    "nodes",
    "partition",
    "reservation",
    "nodelist",
    "exclude",
    "time",
    "gpus_per_node",
    "account",
    "qos",
    "exclusive",
    "mem",
    "constraint",
)
# Where the job runs: given in `slurm` or in its `node_selector` object.
NODE_SELECTOR_KEYS = ("partition", "reservation", "nodelist", "exclude")
# madengine's `slurm` keys that shape the job beyond its request (docs/madengine-configs.md): the results dir
# (results_dir, else output_dir), each node's workspace, the socket interface of the container's collectives, and
# the environment modules the job script loads before the pipeline.
SLURM_JOB_KEYS = ("results_dir", "output_dir", "shared_workspace", "network_interface", "modules")
# madengine's `slurm` keys of its own GPU-node preflight, which slurm-multi answers its own way: stale containers of
# ended jobs are removed on every node, and `submit --preflight` checks the candidate nodes.
SLURM_KEYS_WITHOUT_EFFECT = (
    "enable_node_check",
    "auto_cleanup_nodes",
    "allow_submit_without_clean_nodes",
    "verbose_node_check",
)
SLURM_KEYS = SLURM_REQUEST_KEYS + ("node_selector",) + SLURM_JOB_KEYS + SLURM_KEYS_WITHOUT_EFFECT
# The `slurm` keys holding one string (a path or an interface name); `modules` holds a list of them.
_SLURM_STRING_KEYS = ("results_dir", "output_dir", "shared_workspace", "network_interface")
# The container variables `slurm.network_interface` sets, as madengine's job script does (RCCL reads NCCL's).
SOCKET_INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# MAD's additional-context keys (madengine's context and validators), and the sections of its deployment_config.
CONTEXT_KEYS = (
    "gpu_vendor",
    "guest_os",
    "host_os",
    "docker_build_arg",
    "docker_env_vars",
    "docker_mounts",
    "docker_gpus",
    "docker_cpus",
    "MAD_CONTAINER_IMAGE",
    "MAD_ROCM_PATH",
    "rocm_path",
    "timeout",
    "tools",
    "pre_scripts",
    "post_scripts",
    "encapsulate_script",
    "model_args",
    "data",
    "shared_data",
    "numa_balancing",
    "rocenv_mode",
    "gen_sys_env_details",
    "generate_sys_env_details",
    "log_error_pattern_scan",
    "log_error_patterns",
    "log_error_benign_patterns",
    "skip_perf_collection",
    "live_output",
    "gpu_renderDs",
    "monitor",
    "cleanup_on_failure",
)
DEPLOYMENT_SECTIONS = ("slurm", "distributed", "k8s", "kubernetes", "vllm", "env_vars", "debug", "deploy", "target")
TOP_LEVEL_KEYS = DEPLOYMENT_SECTIONS + CONTEXT_KEYS
# Keys whose value must be an object (madengine refuses anything else too).
OBJECT_KEYS = (
    "slurm",
    "distributed",
    "k8s",
    "kubernetes",
    "vllm",
    "env_vars",
    "docker_build_arg",
    "docker_env_vars",
    "docker_mounts",
)
# An environment module's name as `module load` takes it (rocm/6.2.0, gcc/11.2.0, openmpi/4.1.4-gcc).
MODULE_NAME = re.compile(r"^[A-Za-z0-9_.+-][A-Za-z0-9_.+/-]*$")
# How close an unknown key must be to a known one to be taken for a misspelling of it (difflib's ratio: `slrum`
# against `slurm` is 0.8).
MISSPELLING_CUTOFF = 0.8


class DeploymentConfigError(RunContextError):
    """A deployment config, or a context's `slurm` section, holding a key or value that cannot be used as given."""


def _is_comment(key) -> bool:
    return isinstance(key, str) and key.startswith("_")


def closest_key(key: str, valid, cutoff: float = 0.6):
    """The valid key `key` most likely stands for (the same but for case first), or None."""
    by_case = [name for name in valid if name.lower() == key.lower()]
    if by_case:
        return by_case[0]
    matches = difflib.get_close_matches(key, list(valid), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _unknown_key(where: str, key: str, valid, what: str) -> DeploymentConfigError:
    suggestion = closest_key(key, valid)
    hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
    return DeploymentConfigError(f"{where}: unknown key {key!r}{hint}; {what}")


def _check_slurm_section(slurm, source: str) -> dict:
    """`slurm` checked, with its node_selector read as the same settings of `slurm` itself."""
    if not isinstance(slurm, dict):
        raise DeploymentConfigError(
            f'{source}: slurm must be an object such as {{"nodes": 2}}, not a {type(slurm).__name__}'
        )
    flat = {}
    for key, value in slurm.items():
        if _is_comment(key):
            continue
        if key not in SLURM_KEYS:
            raise _unknown_key(
                source,
                f"slurm.{key}",
                [f"slurm.{name}" for name in SLURM_KEYS],
                "the slurm keys are listed in docs/using.md (The slurm keys)",
            )
        if key == "exclusive" and not isinstance(value, bool):
            # A string "false" would read as true: whole nodes asked for without the user wanting them.
            raise DeploymentConfigError(
                f"{source}: slurm.exclusive must be true or false, not a {type(value).__name__}"
            )
        _check_slurm_value(key, value, source)
        if key != "node_selector":
            flat[key] = value
    selector = slurm.get("node_selector", {})
    if not isinstance(selector, dict):
        raise DeploymentConfigError(
            f'{source}: slurm.node_selector must be an object such as {{"partition": "gpu"}}, '
            f"not a {type(selector).__name__}"
        )
    for key, value in selector.items():
        if _is_comment(key):
            continue
        if key not in NODE_SELECTOR_KEYS:
            raise _unknown_key(
                source,
                f"slurm.node_selector.{key}",
                [f"slurm.node_selector.{name}" for name in NODE_SELECTOR_KEYS],
                f"a node_selector holds {', '.join(NODE_SELECTOR_KEYS)}",
            )
        if key in flat and flat[key] != value:
            raise DeploymentConfigError(
                f"{source}: slurm.{key} and slurm.node_selector.{key} have different values: keep one of them"
            )
        flat[key] = value
    return flat


def _check_slurm_value(key: str, value, source: str) -> None:
    if key in _SLURM_STRING_KEYS and (not isinstance(value, str) or not value.strip()):
        given = "an empty one" if value == "" else type(value).__name__
        raise DeploymentConfigError(f"{source}: slurm.{key} must be a non-empty string, not {given}")
    if key == "network_interface" and re.search(r"[\s\x00-\x1f]", value):
        raise DeploymentConfigError(
            f"{source}: slurm.network_interface holds whitespace: give an interface name (ib0), or NCCL's "
            "list form (ib0,ib1 or ^docker)"
        )
    if key == "modules":
        if not isinstance(value, list) or not all(isinstance(name, str) and MODULE_NAME.match(name) for name in value):
            raise DeploymentConfigError(
                f"{source}: slurm.modules must be a list of environment module names such as "
                f'["rocm/6.2.0", "gcc/11.2.0"]; each a word of letters, digits and . _ + - /'
            )


def deployment_env_vars(context) -> dict:
    """The container's user variables of a job's config: its `env_vars` (madengine's job script exports them), then
    `slurm.network_interface` as NCCL's and gloo's socket interface (over slurm-multi's own choice, the interface of
    the route to MASTER_ADDR), then `docker_env_vars` over both, as madengine's container runner merges them."""
    context = context or {}
    merged = {str(name): value for name, value in (context.get("env_vars") or {}).items() if not _is_comment(name)}
    interface = (context.get("slurm") or {}).get("network_interface")
    if interface:
        merged.update((name, interface) for name in SOCKET_INTERFACE_VARIABLES)
    merged.update(context.get("docker_env_vars") or {})
    return merged


def _check_top_level_value(key: str, value, source: str) -> None:
    """madengine's keys whose other values would ask for what this tool does not do: refused, never ignored."""
    if key in ("deploy", "target") and value not in ("slurm", "", None):
        raise DeploymentConfigError(
            f'{source}: {key} is {value!r}: slurm-multi deploys on SLURM only; drop {key} or give "slurm"'
        )
    if key == "debug" and value not in (False, None):
        raise DeploymentConfigError(
            f"{source}: debug is {value!r}: slurm-multi has no debug mode (every node's log and a failed container's "
            "diagnostics are always kept; -v shows Ansible's detail): drop debug or set it to false"
        )
    if key in ("pre_scripts", "post_scripts") and value not in ([], None):
        raise DeploymentConfigError(
            f"{source}: {key} in the job's config are not run by slurm-multi: give the scripts as a tool of MAD's "
            "tools.json (its pre_scripts and post_scripts run on every node, docs/tools.md), or drop the key"
        )


def check_config(config, source: str, strict: bool = False) -> dict:
    """`config` (one source) checked, comments dropped, `slurm.node_selector` read into `slurm`; ``strict``: every
    top-level key must be known, else only near misses are refused. Errors name ``source``, the key and the closest."""
    if not isinstance(config, dict):
        raise DeploymentConfigError(f"{source} must be a JSON object ({{...}}), not a {type(config).__name__}")
    checked = {}
    for key, value in config.items():
        if _is_comment(key):
            continue
        if key not in TOP_LEVEL_KEYS:
            near_miss = closest_key(key, TOP_LEVEL_KEYS, cutoff=MISSPELLING_CUTOFF)
            if strict or near_miss:
                raise _unknown_key(
                    source,
                    key,
                    TOP_LEVEL_KEYS,
                    f"a deployment config holds the sections {', '.join(DEPLOYMENT_SECTIONS)} and MAD's context keys "
                    "(gpu_vendor, docker_env_vars, ...); give a Dockerfile CONTEXT key with -c",
                )
        if key in OBJECT_KEYS and not isinstance(value, dict):
            raise DeploymentConfigError(f"{source}: {key} must be an object ({{...}}), not a {type(value).__name__}")
        _check_top_level_value(key, value, source)
        checked[key] = _check_slurm_section(value, source) if key == "slurm" else value
    return checked


def read_config_file(path) -> dict:
    """A deployment config file (JSON, or MAD's Python-dict form), checked (`check_config`)."""
    source = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise DeploymentConfigError(f"cannot read the deployment config {path}: {error.strerror}") from None
    return check_config(parse_additional_context(text, source=source), source, strict=True)


def merge_config(*layers) -> dict:
    """The layers, lowest first, merged recursively into one config: the one place sources are merged."""
    return reduce(deep_merge, (layer or {} for layer in layers), {})


def _secrets_as_references(value):
    if isinstance(value, dict):
        return {
            key: "${" + key + "}" if is_secret_name(key) else _secrets_as_references(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_secrets_as_references(item) for item in value]
    return value


def manifest_deployment_config(config) -> dict:
    """What a build manifest records of the job's config as its `deployment_config`: MAD's deployment sections
    only (its context keys go to the manifest's `context`), each `MAD_SECRETS_*` at any depth as `${NAME}`."""
    return _secrets_as_references({key: config[key] for key in DEPLOYMENT_SECTIONS if key in (config or {})})
