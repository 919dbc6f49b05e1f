"""Which of the node's GPUs a container gets, and how the container is told.

Docker starts containers from its own daemon, outside SLURM's device cgroup: a container run with "all GPUs"
would use GPUs that SLURM gave to other jobs. So the container gets exactly the allocation's GPUs, named by the
indices in `SLURM_STEP_GPUS` / `SLURM_JOB_GPUS`.

Those indices are Slurm's GPU indices for the node. Since Slurm 21.08 they are positions in the node's GPU list
(ordered as the GPUs enumerate on the PCI bus), which is the numbering of `amd-smi`, `rocm-smi` and `nvidia-smi`.
Older Slurm printed the digits of the gres.conf device file instead (`/dev/dri/renderD128` gave 128); such an
index is not one of the node's GPUs and is refused with an error rather than guessed.
"""

from __future__ import annotations

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
    """Sorted GPU indices from a SLURM list such as `0,2`, `0-3` or `0-1,4`.

    Strict: anything else (spaces inside items, empty items, reversed ranges, a GPU listed twice, `NoDevFiles`)
    raises ValueError naming the variable and its value.
    """

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
    """The GPU indices SLURM allocated on this node, from `SLURM_STEP_GPUS` else `SLURM_JOB_GPUS`.

    None when neither is set (or both are empty): the allocation names no GPUs, e.g. a plain `--exclusive`
    allocation without `--gres`/`--gpus`. Raises ValueError for a malformed value.
    """
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
    """The GPU records (from gpu_facts) of the allocation, in index order.

    `indices` None means no SLURM GPU allocation: every GPU of the node, which is what an exclusive allocation
    of the whole node means. An index that is not one of the node's GPUs raises ValueError.
    """
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
    """`docker run` arguments that give the container the allocation's GPUs and no other.

    AMD: `/dev/kfd` (the compute interface every ROCm process opens) and the render node of each GPU
    (`/dev/dri/renderD<N>` from the facts, else 128 + index); `--group-add video` so a non-root user in the
    container may open them (Docker resolves the name in the image's /etc/group, which every Debian, Ubuntu and
    RHEL based ROCm image has); `--security-opt seccomp=unconfined` because ROCm's NUMA-aware allocator calls
    `mbind`/`set_mempolicy`/`move_pages`, which Docker's default seccomp profile refuses, and AMD's documented run
    line uses it (benchmarks must run as they would under MAD).
    NVIDIA: `--gpus` with one argv element `"device=0,2"`: the double quotes are part of the value, because
    docker reads `--gpus` as CSV and would otherwise split `device=0,2` into `device=0` and a count `2`.
    none (or no GPU selected): no arguments.
    `indices` None gives every GPU in `gpus` (see select_gpus); an index the node lacks raises ValueError.
    """
    vendor = _vendor(vendor)
    if vendor == VENDOR_NONE:
        return []
    selected = select_gpus(indices, gpus)
    if not selected:
        return []
    if vendor == VENDOR_NVIDIA:
        devices = ",".join(str(gpu["index"]) for gpu in selected)
        return ["--gpus", f'"device={devices}"']
    args = ["--device", "/dev/kfd"]
    for gpu in selected:
        render_node = gpu.get("render_node")
        if render_node is None:
            render_node = FIRST_RENDER_NODE + gpu["index"]
        args += ["--device", f"/dev/dri/renderD{render_node}"]
    return args + ["--group-add", "video", "--security-opt", "seccomp=unconfined"]


def gpu_env(vendor: str, indices: Optional[List[int]]) -> Dict[str, str]:
    """The GPU variables for the container's environment.

    The container holds only the allocated devices, and the runtimes number what they can see from 0. So the
    in-container lists are `0..k-1`, never the host's indices: `ROCR_VISIBLE_DEVICES=2,3` in a container holding
    two GPUs would hide both. Setting them (rather than nothing) also overrides host values SLURM may have set
    and tells model scripts how many GPUs they have.
    AMD: `ROCR_VISIBLE_DEVICES` and `HIP_VISIBLE_DEVICES` = `0..k-1` (HIP counts within what ROCr shows, so equal
    lists compose to the same devices).
    NVIDIA: `CUDA_VISIBLE_DEVICES` = `0..k-1` (inside), and `NVIDIA_VISIBLE_DEVICES` = the host indices, because the
    NVIDIA container runtime reads that one on the host side to pick devices (the same ones `--gpus` names);
    `void` when no GPU is selected, so an image's `NVIDIA_VISIBLE_DEVICES=all` cannot hand it every GPU.
    `indices` None (no SLURM GPU allocation: the container has all the node's GPUs) and vendor none give {}.
    """
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
