"""The container's command as a user reads it: the runtime's argv and its env file's variables, secrets masked, in the
same lines for `submit --dry-run` and the head of every node's run.log; ``<...>`` marks what only the node knows."""

from __future__ import annotations

import re
import shlex
from typing import List, Mapping, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets

# Marks what the login node cannot know before the job runs (the dry run), each in one argument. A whole argument
# that is one mark stands for none or several arguments; a mark inside an argument for part of one.
NODE_GPUS = (
    "<GPU arguments of the node, from its GPUs and SLURM_JOB_GPUS: AMD --device /dev/kfd, --device "
    "/dev/dri/renderD<N> per allocated GPU, --group-add video and the group of the render devices, --security-opt "
    "seccomp=unconfined; NVIDIA --gpus device=<SLURM_JOB_GPUS>; with the GPU variables>"
)
NODE_FABRIC = "<if the node has /dev/infiniband: --device /dev/infiniband --ulimit memlock=-1:-1>"
NODE_GPU_COUNT = "<GPUs allocated on the node>"
NODE_ROUTE_INTERFACE = "<interface of the route of the node to MASTER_ADDR (unset where none)>"
ENV_FILE = "<node-local env file>"
NODE_VALUE = "<on the node>"
# The variables that only the node's GPUs decide: the dry run shows them within NODE_GPUS.
NODE_GPU_VARIABLES = (
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "MAD_GPU_VENDOR",
    "MAD_SYSTEM_NGPUS",
    "MAD_SYSTEM_GPU_ARCHITECTURE",
    "MAD_SYSTEM_GPU_PRODUCT_NAME",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
)
COMMAND_PREFIX = "slurm-multi: container command: "
ENV_FILE_PREFIX = "slurm-multi: container env file: "
# One mark: `<...>`, holding at most one level of `<...>` within (NODE_GPUS).
MARK = re.compile(r"<[^<>]*(?:<[^<>]*>[^<>]*)*>")


def command_line(argv: Sequence[str], secret_values: Sequence[str] = ()) -> str:
    """``argv`` as one shell-quoted line, secret values masked."""
    return " ".join(shlex.quote(mask_secrets(str(arg), secret_values)) for arg in argv)


def command_lines(
    argv: Sequence[str], env_file_variables: Mapping[str, str], secret_values: Sequence[str] = ()
) -> List[str]:
    """The record of a container's command: its argv, then each variable of its env file (``--env-file``: the user's
    docker_env_vars and the job's secrets) with its value, secrets masked."""
    lines = [COMMAND_PREFIX + command_line(argv, secret_values)]
    for name in sorted(env_file_variables):
        lines.append(ENV_FILE_PREFIX + mask_secrets(f"{name}={env_file_variables[name]}", secret_values))
    return lines
