"""Reading a container's command back from a run.log or a dry run's output (module_utils/run/container_command.py)."""

import re
import shlex
from collections.abc import Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import (
    COMMAND_PREFIX,
    MARK,
    NODE_GPU_VARIABLES,
)


def recorded_argv(log_text: str) -> list[str]:
    """The argv a run.log (or a dry run's output) records in its first command line; [] when it holds none."""
    for line in log_text.splitlines():
        if line.startswith(COMMAND_PREFIX):
            return shlex.split(line[len(COMMAND_PREFIX) :])
    return []


def argv_matches(planned: Sequence[str], actual: Sequence[str]) -> bool:
    """Whether ``actual`` is what ``planned`` (a dry run's argv, with node marks) says: equal argument by argument,
    a mark inside an argument standing for any text, an argument that is one mark for any arguments."""
    separator = "\x00"
    pattern = ""
    for arg in planned:
        if MARK.fullmatch(arg):
            pattern += "(?:[^\x00]*\x00)*?"
            continue
        pieces = MARK.split(arg)
        pattern += "[^\x00]*?".join(re.escape(piece) for piece in pieces) + separator
    return re.fullmatch(pattern, "".join(arg + separator for arg in actual)) is not None


def without_node_gpu_variables(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``-e NAME=VALUE`` pairs of the variables a dry run shows within its GPU mark."""
    kept, skip = [], False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if arg == "-e" and following.split("=", 1)[0] in NODE_GPU_VARIABLES:
            skip = True
            continue
        kept.append(arg)
    return kept
