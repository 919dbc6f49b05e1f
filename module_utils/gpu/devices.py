"""Which of the node's GPUs a container gets (exactly the allocation's: Docker starts containers outside SLURM's
device cgroup), and how the container is told."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.facts import (
    VENDOR_AMD,
    VENDOR_NONE,
    VENDOR_NVIDIA,
)

# SLURM_STEP_GPUS narrows SLURM_JOB_GPUS to one step (srun --gpus inside an allocation), so it wins.
SLURM_GPU_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")

# The first render node the DRM subsystem hands out; used only when the facts do not know a GPU's node.
FIRST_RENDER_NODE = 128

_MAX_GPU_INDEX = 65535
_INDEX_OR_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_gpu_index_list(value: str, variable: str) -> List[int]:
    """Sorted GPU indices from a SLURM list such as `0,2`, `0-3` or `0-1,4`; anything else raises ValueError."""

    def refuse(problem: str) -> ValueError:
        return ValueError(f"{variable}={value!r}: {problem} (expected GPU indices such as 0,1 or 0-3)")

    if value.strip() == "NoDevFiles":
        raise refuse("SLURM does not know the GPUs' device files; set File= for them in gres.conf")
    indices: Set[int] = set()
    for item in value.strip().split(","):
        match = _INDEX_OR_RANGE.match(item)
        if not match:
            raise refuse(f"{item!r} is not a GPU index or range")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise refuse(f"the range {item!r} runs backwards")
        if last > _MAX_GPU_INDEX:
            raise refuse(f"{last} is not a plausible GPU index")
        for index in range(first, last + 1):
            if index in indices:
                raise refuse(f"GPU {index} is listed twice")
            indices.add(index)
    return sorted(indices)


def allocated_gpu_indices(env: Mapping[str, str]) -> Optional[List[int]]:
    """The GPU indices SLURM allocated on this node, from `SLURM_STEP_GPUS` else `SLURM_JOB_GPUS`; None when the
    allocation names no GPUs (e.g. `--exclusive` without `--gres`/`--gpus`)."""
    for variable in SLURM_GPU_VARIABLES:
        value = env.get(variable)
        if value is not None and value.strip():
            return parse_gpu_index_list(value, variable)
    return None


def _vendor(vendor: str) -> str:
    for known in (VENDOR_AMD, VENDOR_NVIDIA, VENDOR_NONE):
        if isinstance(vendor, str) and vendor.strip().lower() == known.lower():
            return known
    raise ValueError(f"GPU vendor {vendor!r} is not one of {VENDOR_AMD}, {VENDOR_NVIDIA}, {VENDOR_NONE}")


def select_gpus(indices: Optional[Sequence[int]], gpus: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The allocation's GPU records in index order (all the node's for `indices` None); ValueError for one it lacks."""
    if indices is None:
        return sorted(gpus, key=lambda gpu: gpu["index"])
    by_index = {gpu["index"]: gpu for gpu in gpus}
    unknown = [index for index in indices if index not in by_index]
    if unknown:
        known = ", ".join(str(index) for index in sorted(by_index)) or "none"
        raise ValueError(
            f"SLURM allocated GPU(s) {', '.join(str(index) for index in unknown)}, which this node does not have "
            f"(its GPUs: {known}); check gres.conf against the node's GPUs (Slurm older than 21.08 numbers GPUs "
            "by their device file, e.g. 128 for /dev/dri/renderD128)"
        )
    return [by_index[index] for index in sorted(set(indices))]


def docker_gpu_args(vendor: str, indices: Optional[List[int]], gpus: List[dict]) -> List[str]:
    """`docker run` arguments that give the container the allocation's GPUs and no other (`select_gpus`).

    AMD's `seccomp=unconfined`: ROCm's NUMA-aware allocator calls `mbind`, which Docker's default profile refuses (AMD's
    documented run line uses it too). NVIDIA's `--gpus "device=0,2"` keeps its quotes: docker reads `--gpus` as CSV."""
    vendor = _vendor(vendor)
    if vendor == VENDOR_NONE:
        return []
    selected = select_gpus(indices, gpus)
    if not selected:
        return []
    if vendor == VENDOR_NVIDIA:
        devices = ",".join(str(gpu["index"]) for gpu in selected)
        return ["--gpus", f'"device={devices}"']
    devices = ["/dev/kfd"]
    for gpu in selected:
        render_node = gpu.get("render_node")
        if render_node is None:
            render_node = FIRST_RENDER_NODE + gpu["index"]
        devices.append(f"/dev/dri/renderD{render_node}")
    args = [arg for device in devices for arg in ("--device", device)] + ["--group-add", "video"]
    for group in device_group_ids(devices):
        args += ["--group-add", str(group)]
    return args + ["--security-opt", "seccomp=unconfined"]


def device_group_ids(paths: Sequence[str]) -> List[int]:
    """The groups owning the device files that exist (root's left out), by number: a user that is not root inside the
    image needs the render group for /dev/kfd and /dev/dri/renderD*, and an image need not name that group (Ubuntu's
    has video, not render), while `--group-add <name>` fails on a name the image lacks."""
    groups = set()
    for path in paths:
        try:
            group = os.stat(path).st_gid
        except OSError:
            continue
        if group:
            groups.add(group)
    return sorted(groups)


def gpu_env(vendor: str, indices: Optional[List[int]]) -> Dict[str, str]:
    """The GPU variables for the container's environment; {} for no SLURM GPU allocation or vendor none.

    The container holds only the allocated devices, numbered from 0, so the in-container lists are `0..k-1`;
    `NVIDIA_VISIBLE_DEVICES` holds host indices (the runtime reads it on the host), `void` when no GPU is selected."""
    vendor = _vendor(vendor)
    if vendor == VENDOR_NONE or indices is None:
        return {}
    host = sorted(set(indices))
    inside = ",".join(str(position) for position in range(len(host)))
    if vendor == VENDOR_NVIDIA:
        if not host:
            return {"NVIDIA_VISIBLE_DEVICES": "void"}
        return {"NVIDIA_VISIBLE_DEVICES": ",".join(str(index) for index in host), "CUDA_VISIBLE_DEVICES": inside}
    if not host:
        return {}
    return {"ROCR_VISIBLE_DEVICES": inside, "HIP_VISIBLE_DEVICES": inside}
