"""MAD's launcher contract: the variables madengine's SLURM launchers give a container, with the same values
(docs/contracts.md, "Launchers"). "Identity" variables win over a ``docker_env_vars`` entry; "defaults" yield."""

from __future__ import annotations

import difflib
import fcntl
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# madengine's names, each once; the row's `launcher` column says one of these.
LAUNCHERS = (
    "torchrun",
    "deepspeed",
    "megatron-lm",
    "torchtitan",
    "primus",
    "vllm",
    "sglang",
    "sglang-disagg",
    "slurm_multi",
)
ALIASES = {"megatron": "megatron-lm", "sglang_disagg": "sglang-disagg", "slurm-multi": "slurm_multi"}
NO_LAUNCHER = "slurm_multi"
# Launchers whose scripts start their processes through $MAD_MULTI_NODE_RUNNER.
TORCHRUN_FAMILY = ("torchrun", "megatron-lm", "torchtitan")
# SGLang disaggregated serving: a proxy, at least one prefill node and one decode node.
SGLANG_DISAGG_MIN_NODES = 3
# madengine's: long enough for every node to pull or load a fresh image before the rendezvous closes.
TORCH_ELASTIC_RDZV_TIMEOUT = 3600
DEFAULT_BACKEND = "nccl"
PRIMUS_DEFAULT_CONFIG = "exp_pretrain.yaml"
# `primus_pretrain/<token>_<arch>_...` model names: the token's BACKEND (madengine's primus_backend.py).
_PRIMUS_BACKENDS = {
    "maxtext": "MaxText",
    "torchtitan": "torchtitan",
    "megatron": "megatron",
    "megatron_bridge": "megatron_bridge",
    "moe_package": "moe_package",
}
# Inside the container: the model dir is mounted at /myworkspace (model_run_spec.WORKSPACE); the launcher's own files
# (workspace_files) are written in the node's dir, where the job's files live, and mounted read-only under here.
LAUNCHER_FILES_DIR = "/slurm-multi"
DEEPSPEED_HOSTFILE = "deepspeed-hostfile"
_SIOCGIFADDR = 0x8915
# madengine's DEFAULT_GUEST_OS (core/additional_context_defaults.py), which a context's guest_os replaces.
MADENGINE_GUEST_OS = "UBUNTU"
# The vendors madengine names in MAD_GPU_VENDOR (a node without GPUs is none of them: it leaves it unset).
MADENGINE_GPU_VENDORS = ("AMD", "NVIDIA")


class LauncherError(UserError):
    """A launcher or `distributed` setting that cannot be used as given, said with the fix."""


def canonical_launcher(name: Any) -> str:
    """madengine's name for ``name`` (an alias or a ``-``/``_`` variant of one); empty or None: NO_LAUNCHER."""
    if name is None or name == "":
        return NO_LAUNCHER
    if not isinstance(name, str):
        raise LauncherError(f"distributed.launcher must be a launcher's name, not a {type(name).__name__} ({name!r})")
    text = name.strip().lower()
    for candidate in (text, text.replace("_", "-"), text.replace("-", "_")):
        if candidate in LAUNCHERS:
            return candidate
        if candidate in ALIASES:
            return ALIASES[candidate]
    closest = difflib.get_close_matches(text, list(LAUNCHERS) + list(ALIASES), n=1, cutoff=0.5)
    hint = f" (did you mean {ALIASES.get(closest[0], closest[0])!r}?)" if closest else ""
    raise LauncherError(f"unknown launcher {name!r}{hint}: distributed.launcher is one of {', '.join(LAUNCHERS)}")


def _merged(low: Mapping[str, Any], high: Mapping[str, Any]) -> Dict[str, Any]:
    merged = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            value = _merged(merged[key], value)
        merged[key] = value
    return merged


def _section(owner: Mapping[str, Any], what: str) -> Dict[str, Any]:
    section = owner.get("distributed") if isinstance(owner, Mapping) else None
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise LauncherError(
            f'{what}: distributed must be an object such as {{"launcher": "torchrun"}}, not a {type(section).__name__}'
        )
    return {key: value for key, value in section.items() if not str(key).startswith("_")}


def _positive_int(settings: Mapping[str, Any], key: str, label: str) -> Optional[int]:
    value = settings.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"distributed.{label} must be a whole number of at least 1, not {value!r}")
    return value


@dataclass
class Distributed:
    """A model's launcher and the `distributed` settings it reads, checked."""

    launcher: str = NO_LAUNCHER
    nproc_per_node: Optional[int] = None
    port: Optional[int] = None
    backend: str = DEFAULT_BACKEND
    prefill_nodes: Optional[int] = None
    decode_nodes: Optional[int] = None
    primus: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """What the run module takes back (`distributed_from_dict`)."""
        return {
            "launcher": self.launcher,
            "nproc_per_node": self.nproc_per_node,
            "port": self.port,
            "backend": self.backend,
            "sglang_disagg": {"prefill_nodes": self.prefill_nodes, "decode_nodes": self.decode_nodes},
            "primus": dict(self.primus),
        }


def model_distributed(card: Mapping[str, Any], context: Mapping[str, Any], nnodes: Optional[int] = None) -> Distributed:
    """The card's `distributed` section with the job's config (`context`) over it, checked against ``nnodes`` (the
    job's node count, when known): an unknown launcher, a bad number, or too few nodes are refused."""
    name = card.get("name", "?") if isinstance(card, Mapping) else "?"
    settings = _merged(_section(card, f"model {name!r}"), _section(context, "the job's config"))
    return distributed_from_dict(settings, nnodes)


def distributed_from_dict(settings: Mapping[str, Any], nnodes: Optional[int] = None) -> Distributed:
    """`Distributed` from a `distributed` section (or `Distributed.as_dict`), checked as `model_distributed` says."""
    launcher = canonical_launcher(settings.get("launcher"))
    port = _positive_int(settings, "port", "port")
    # madengine's configs also spell the rendezvous port master_port (its Megatron example).
    master_port = _positive_int(settings, "master_port", "master_port")
    if port is not None and master_port is not None and port != master_port:
        raise LauncherError(f"distributed.port {port} and distributed.master_port {master_port} differ: keep one")
    port = port if port is not None else master_port
    if port is not None and port > 65535:
        raise LauncherError(f"distributed.port must be a TCP port (1-65535), not {port}")
    given_nnodes = _positive_int(settings, "nnodes", "nnodes")
    if given_nnodes is not None and nnodes is not None and given_nnodes != nnodes:
        raise LauncherError(
            f"distributed.nnodes {given_nnodes} differs from the job's {nnodes} nodes: the job's nodes are the "
            f"launcher's; drop distributed.nnodes or ask for {given_nnodes} nodes"
        )
    disagg = settings.get("sglang_disagg") or {}
    primus = settings.get("primus") or {}
    for key, section in (("sglang_disagg", disagg), ("primus", primus)):
        if not isinstance(section, Mapping):
            raise LauncherError(f"distributed.{key} must be an object, not a {type(section).__name__}")
    backend = settings.get("backend") or DEFAULT_BACKEND
    if not isinstance(backend, str):
        raise LauncherError(f"distributed.backend must be a name such as 'nccl' or 'gloo', not {backend!r}")
    distributed = Distributed(
        launcher=launcher,
        nproc_per_node=_positive_int(settings, "nproc_per_node", "nproc_per_node"),
        port=port,
        backend=backend,
        prefill_nodes=_positive_int(disagg, "prefill_nodes", "sglang_disagg.prefill_nodes"),
        decode_nodes=_positive_int(disagg, "decode_nodes", "sglang_disagg.decode_nodes"),
        primus={key: value for key, value in primus.items() if value is not None},
    )
    if nnodes is not None:
        check_node_count(distributed, nnodes)
    return distributed


def check_node_count(distributed: Distributed, nnodes: int) -> None:
    """Refuse a job too small for its launcher (sglang-disagg: a proxy, a prefill and a decode node)."""
    if distributed.launcher != "sglang-disagg":
        return
    if nnodes < SGLANG_DISAGG_MIN_NODES:
        raise LauncherError(
            f"launcher sglang-disagg needs at least {SGLANG_DISAGG_MIN_NODES} nodes (1 proxy, 1 prefill, 1 decode), "
            f"the job has {nnodes}: ask for {SGLANG_DISAGG_MIN_NODES} or more nodes"
        )
    disagg_split(nnodes, distributed)


def disagg_split(nnodes: int, distributed: Distributed) -> Tuple[int, int]:
    """(prefill nodes, decode nodes) after rank 0's proxy: distributed.sglang_disagg's, else madengine's ~40/60."""
    prefill, decode = distributed.prefill_nodes, distributed.decode_nodes
    if prefill is None and decode is None:
        prefill = max(1, (nnodes - 1) * 2 // 5)
        return prefill, nnodes - 1 - prefill
    if prefill is None or decode is None or prefill + decode + 1 != nnodes:
        raise LauncherError(
            f"distributed.sglang_disagg: prefill_nodes ({prefill}) + decode_nodes ({decode}) + 1 proxy must equal "
            f"the job's {nnodes} nodes: give both so they add up, or neither for the default split"
        )
    return prefill, decode


@dataclass
class LaunchSite:
    """Where one node's container runs: the job's topology as this node sees it."""

    rank: int
    nnodes: int
    master_addr: str
    master_port: int
    slurm_job_id: str
    # The GPUs the container gets (None or 0: a node without GPUs, which runs one process).
    gpus: Optional[int] = None
    model: str = ""
    # Every node's address in rank order (sglang-disagg's SGLANG_NODE_IPS), and name (deepspeed's hostfile).
    node_addresses: Sequence[str] = ()
    node_names: Sequence[str] = ()
    # The interface carrying this node's route to MASTER_ADDR (None: unknown, the variables are left unset).
    socket_ifname: Optional[str] = None


@dataclass
class LauncherEnvironment:
    """The container's launcher variables: `identity` wins over the user's, `defaults` yield to them."""

    identity: Dict[str, str]
    defaults: Dict[str, str]
    # Files the launcher's command reads: {name: content} (deepspeed's hostfile), at LAUNCHER_FILES_DIR/<name>.
    workspace_files: Dict[str, str] = field(default_factory=dict)


def _torchrun(nnodes: int, nproc: int, site: LaunchSite, port: int) -> str:
    if nnodes == 1:
        return f"torchrun --standalone --nproc_per_node={nproc}"
    return (
        f"torchrun --nnodes={nnodes} --nproc_per_node={nproc} --node_rank={site.rank} "
        f"--master_addr={site.master_addr} --master_port={port}"
    )


def launcher_environment(distributed: Distributed, site: LaunchSite) -> LauncherEnvironment:
    """The variables madengine's SLURM launcher would give this node's container, for the same nodes, GPUs and
    port; NO_LAUNCHER gives none (the pipeline's own topology stands alone)."""
    launcher = distributed.launcher
    if launcher == NO_LAUNCHER:
        return LauncherEnvironment({}, {})
    nnodes, rank = site.nnodes, site.rank
    nproc = distributed.nproc_per_node or site.gpus or 1
    port = distributed.port or site.master_port
    identity = {
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nnodes),
        "NPROC_PER_NODE": str(nproc),
        "GPUS_PER_NODE": str(nproc),
        "LOCAL_RANK": "0",
        "MAD_DEPLOYMENT_TYPE": "slurm",
        "MAD_LAUNCHER_TYPE": launcher,
        "MAD_SLURM_JOB_ID": site.slurm_job_id,
        "MAD_NODE_RANK": str(rank),
        "MAD_TOTAL_NODES": str(nnodes),
        # Only rank 0 reports the job's metrics (the others' are the same all-reduced figures).
        "MAD_COLLECT_METRICS": "true" if rank == 0 else "false",
    }
    defaults = {"DISTRIBUTED_BACKEND": distributed.backend}
    if nnodes > 1:
        defaults["TORCH_ELASTIC_RDZV_TIMEOUT"] = str(TORCH_ELASTIC_RDZV_TIMEOUT)
    if site.socket_ifname:
        defaults["NCCL_SOCKET_IFNAME"] = defaults["GLOO_SOCKET_IFNAME"] = site.socket_ifname
    files = {}  # type: Dict[str, str]
    multi = nnodes > 1
    if launcher in TORCHRUN_FAMILY:
        identity["MAD_MULTI_NODE_RUNNER"] = _torchrun(nnodes, nproc, site, port)
    if launcher == "megatron-lm":
        defaults.update(
            TENSOR_MODEL_PARALLEL_SIZE=str(nproc if multi or not isinstance(nproc, int) else min(nproc, 8)),
            PIPELINE_MODEL_PARALLEL_SIZE=str(nnodes if multi else 1),
            CONTEXT_PARALLEL_SIZE="1",
        )
    elif launcher == "torchtitan":
        defaults.update(
            TORCHTITAN_TENSOR_PARALLEL_SIZE=str(nproc), TORCHTITAN_PIPELINE_PARALLEL_SIZE=str(nnodes if multi else 1)
        )
        if multi:
            defaults.update(TORCHTITAN_FSDP_ENABLED="1", TORCHTITAN_CONTEXT_PARALLEL_SIZE="1")
    elif launcher == "deepspeed":
        if multi:
            files[DEEPSPEED_HOSTFILE] = "".join(f"{name} slots={nproc}\n" for name in site.node_names)
            identity["MAD_MULTI_NODE_RUNNER"] = (
                f"deepspeed --hostfile={LAUNCHER_FILES_DIR}/{DEEPSPEED_HOSTFILE} --master_addr={site.master_addr} "
                f"--master_port={port}"
            )
        else:
            identity["MAD_MULTI_NODE_RUNNER"] = f"deepspeed --num_gpus={nproc}"
    elif launcher == "vllm":
        defaults.update(
            VLLM_TENSOR_PARALLEL_SIZE=str(nproc),
            VLLM_PIPELINE_PARALLEL_SIZE="1",
            # One serve per node, no shared Ray, when there are several: data parallel.
            VLLM_DISTRIBUTED_BACKEND="none" if multi else "auto",
        )
    elif launcher == "sglang":
        defaults.update(SGLANG_TENSOR_PARALLEL_SIZE=str(nproc), SGLANG_PIPELINE_PARALLEL_SIZE="1")
    elif launcher == "sglang-disagg":
        prefill, decode = disagg_split(nnodes, distributed)
        if len(site.node_addresses) != nnodes:
            raise LauncherError(
                f"sglang-disagg needs every node's address: {len(site.node_addresses)} known of {nnodes}"
            )
        identity.update(
            SGLANG_DISAGG_MODE="enabled",
            SGLANG_DISAGG_PREFILL_NODES=str(prefill),
            SGLANG_DISAGG_DECODE_NODES=str(decode),
            SGLANG_DISAGG_TOTAL_NODES=str(nnodes),
            SGLANG_NODE_IPS=",".join(site.node_addresses),
            SGLANG_NODE_RANK=str(rank),
        )
        defaults["SGLANG_TP_SIZE"] = str(nproc)
    elif launcher == "primus":
        config = distributed.primus
        defaults["PRIMUS_CONFIG_PATH"] = str(config.get("config_path") or PRIMUS_DEFAULT_CONFIG)
        if str(config.get("cli_extra") or "").strip():
            defaults["PRIMUS_CLI_EXTRA"] = str(config["cli_extra"])
        backend = str(config.get("backend") or "").strip() or primus_backend_of(site.model)
        if backend:
            defaults["BACKEND"] = backend
    return LauncherEnvironment(identity, defaults, files)


def madengine_environment(
    site: LaunchSite,
    vendor: Optional[str],
    node_gpus: Sequence[Mapping[str, Any]],
    multiple_results: Optional[str],
    environ: Mapping[str, str],
    guest_os: str = MADENGINE_GUEST_OS,
) -> LauncherEnvironment:
    """What madengine gives every container of this node, whatever its launcher. ``site.gpus``: the container's GPUs
    (None: unknown); MAD_RUNTIME_NGPUS is set after the user's docker_env_vars, so it alone is identity."""
    identity = {}  # type: Dict[str, str]
    if site.gpus is not None:
        identity["MAD_RUNTIME_NGPUS"] = str(site.gpus)
    defaults = {
        "MAD_MODEL_NAME": site.model,
        # madengine's get_build_number: CI's BUILD_NUMBER, else 0.
        "JENKINS_BUILD_NUMBER": environ.get("BUILD_NUMBER") or "0",
        "MAD_GUEST_OS": guest_os.strip().upper(),
    }
    if multiple_results:
        defaults["MAD_OUTPUT_CSV"] = multiple_results
    if vendor is not None:
        defaults["MAD_SYSTEM_NGPUS"] = str(len(node_gpus))
        vendor = vendor.strip().upper()
    if vendor in MADENGINE_GPU_VENDORS:
        defaults["MAD_GPU_VENDOR"] = vendor
        first = min(node_gpus, key=lambda gpu: gpu["index"]) if node_gpus else {}
        # rocminfo's first gfx name on AMD, `nvidia-smi -L`'s first GPU name on NVIDIA.
        architecture = first.get("arch") if vendor == "AMD" else first.get("name")
        if architecture:
            defaults["MAD_SYSTEM_GPU_ARCHITECTURE"] = str(architecture)
        if first.get("name"):
            defaults["MAD_SYSTEM_GPU_PRODUCT_NAME"] = str(first["name"])
        if vendor == "AMD" and site.gpus:
            # The container's HIP_VISIBLE_DEVICES must hold: rocm/vllm images set 1 here, which makes Ray ignore it.
            defaults["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] = ""
    if site.nnodes > 1:
        # Literally so: the model's script expands LOCAL_RANK per process (madengine's multi-node task script).
        defaults["MIOPEN_USER_DB_PATH"] = f"/tmp/.miopen/node_{site.rank}_rank_${{LOCAL_RANK:-0}}"
    return LauncherEnvironment(identity, defaults)


def primus_backend_of(model: str) -> Optional[str]:
    """BACKEND for a ``primus_pretrain/<token>_...`` model name (madengine's rule), else None."""
    prefix = "primus_pretrain/"
    name = (model or "").strip()
    if not name.startswith(prefix) or not name[len(prefix) :].strip():
        return None
    return _PRIMUS_BACKENDS.get(name[len(prefix) :].strip().split("_", 1)[0].lower())


def route_interface(address: str) -> Optional[str]:
    """The interface this node would send to ``address`` from (a UDP connect sends nothing), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source = probe.getsockname()[0]
    except OSError:
        return None
    return interface_of_address(source)


def interface_of_address(source: str) -> Optional[str]:
    """The interface holding IPv4 address ``source`` (the loopback range is lo's), or None."""
    if source.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(query.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(packed[20:24]) == source:
                return name
    return None


def node_addresses_in_rank_order(
    nodes: Sequence[str], configured: Mapping[str, str], resolve
) -> Tuple[List[str], List[str]]:
    """(every node's address in rank order, the nodes with none): the site config's address, else ``resolve``'s
    first (a node name's non-loopback addresses)."""
    addresses, missing = [], []
    for node in nodes:
        address = configured.get(node) or next(iter(resolve(node)), None)
        if address:
            addresses.append(str(address))
        else:
            missing.append(node)
    return addresses, missing
