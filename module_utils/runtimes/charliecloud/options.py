"""``additional_docker_run_options`` under Charliecloud: the options with a meaning for ``ch-run`` translated (-e/--env,
-v/--volume binds, -w/--workdir); those asking for what a ch-run rank has anyway (the host's network, IPC, /dev and
/dev/shm, no seccomp filter or capability drop of its own, the step's limits) accepted; every other one refused by
name."""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import ModelRunError

# What ch-run does anyway: the host's network, IPC and /dev (devices, /dev/shm), no seccomp or capability set of its
# own, the user's own groups. Asking for it is no error; the GPUs are restricted through *_VISIBLE_DEVICES instead.
_ALREADY_SO = {
    "--network": ("host",),
    "--net": ("host",),
    "--ipc": ("host",),
    "--device": None,
    "--group-add": None,
    "--cap-add": None,
    "--security-opt": None,
    "--shm-size": None,
    "--ulimit": None,
}
_FLAGS_ALREADY_SO = ("--init", "--privileged")
_WITH_VALUE = {"-e": "env", "--env": "env", "-v": "bind", "--volume": "bind", "-w": "workdir", "--workdir": "workdir"}


class ChRunOptions(NamedTuple):
    """What the options ask of ch-run: variables, binds {container path: host path}, a working dir."""

    env: Dict[str, str]
    binds: Dict[str, str]
    workdir: Optional[str]


def _split(token: str) -> (str, Optional[str]):
    if token.startswith("--"):
        name, equals, value = token.partition("=")
        return name, value if equals else None
    if len(token) > 2 and token[:2] in ("-e", "-v", "-w"):
        value = token[2:]
        return token[:2], value[1:] if value.startswith("=") else value
    return token, None


def _bind(spec: str) -> (str, str):
    parts = spec.split(":")
    if len(parts) == 3 and parts[2] in ("rw", "ro"):
        if parts[2] == "ro":
            raise ModelRunError(
                f"additional_docker_run_options: -v {spec}: ch-run 0.31 has no read-only bind; drop ':ro' (the bind "
                "is read-write) or use container_runtime=docker"
            )
        parts = parts[:2]
    if len(parts) != 2 or not parts[0].startswith("/") or not parts[1].startswith("/"):
        raise ModelRunError(
            f"additional_docker_run_options: -v {spec}: under charliecloud a bind is /host/path:/container/path "
            "(no named volumes)"
        )
    return os.path.normpath(parts[1]), parts[0]


def translate(tokens: Sequence[str], environ: Mapping[str, str]) -> ChRunOptions:
    """The ch-run meaning of docker options (already split into tokens); ModelRunError naming an option it has not."""
    env, binds, workdir = {}, {}, None  # type: Dict[str, str], Dict[str, str], Optional[str]
    position = 0
    while position < len(tokens):
        token = tokens[position]
        position += 1
        name, value = _split(token)
        if name in _FLAGS_ALREADY_SO and value is None:
            continue
        if name in _WITH_VALUE or name in _ALREADY_SO:
            if value is None:
                if position >= len(tokens):
                    raise ModelRunError(f"additional_docker_run_options: {name} at the end has no value")
                value = tokens[position]
                position += 1
        if name in _ALREADY_SO:
            allowed = _ALREADY_SO[name]
            if allowed is not None and value not in allowed:
                raise ModelRunError(
                    f"additional_docker_run_options: {name}={value} has no meaning under charliecloud (ch-run shares "
                    f"the host's {name.lstrip('-')}): remove it, or use container_runtime=docker"
                )
            continue
        kind = _WITH_VALUE.get(name)
        if kind == "env":
            variable, equals, setting = value.partition("=")
            if not equals:
                # Docker's `-e NAME`: the value from the environment the run was started with, if any.
                if variable in environ:
                    env[variable] = environ[variable]
                continue
            env[variable] = setting
        elif kind == "bind":
            target, source = _bind(value)
            binds[target] = source
        elif kind == "workdir":
            workdir = value
        else:
            raise ModelRunError(
                f"additional_docker_run_options: {token} has no meaning under charliecloud (ch-run runs the rank as "
                "your own process, with the host's network and devices): remove it, or use container_runtime=docker"
            )
    return ChRunOptions(env, binds, workdir)


def unique(items: List[str]) -> List[str]:
    """``items`` without repeats, in order."""
    return list(dict.fromkeys(items))
