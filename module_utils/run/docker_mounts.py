"""`docker run` mount arguments that never mount one container path twice (Docker refuses "Duplicate mount point"):
a mount the pipeline adds is skipped where the user's `additional_docker_run_options` already mount its target."""

from __future__ import annotations

import collections.abc
import csv
import posixpath
import re
import shlex
from typing import Iterator, List, Optional, Sequence, Set, Tuple, Union

DockerOptions = Union[str, Sequence[str], None]

# `docker run` boolean shorthands that may be bundled in front of -v, as in `-itv /data:/data`.
_VOLUME_SHORTHAND = re.compile(r"^-[ditPq]*v(.*)$", re.DOTALL)
_LONG_FLAGS = ("--volume", "--mount", "--tmpfs")
_MOUNT_TARGET_KEYS = ("target", "dst", "destination")


def _option_tokens(docker_options: DockerOptions) -> List[str]:
    if docker_options is None:
        return []
    if isinstance(docker_options, str):
        try:
            return shlex.split(docker_options)
        except ValueError as error:
            raise ValueError(f"additional docker run options {docker_options!r} cannot be split: {error}") from None
    tokens = list(docker_options)
    if not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"additional docker run options must be strings, got {tokens!r}")
    return tokens


def _mount_flag(token: str) -> Optional[Tuple[str, Optional[str]]]:
    """(flag, value written in the same token or None) when `token` starts a mount option, else None."""
    short = _VOLUME_SHORTHAND.match(token)
    if short:
        flag, attached = "-v", short.group(1)
        # pflag reads `-v=/a:/b` as `-v /a:/b`.
        explicit, attached = attached.startswith("="), attached[1:] if attached.startswith("=") else attached
    else:
        flag, separator, attached = token.partition("=")
        if flag not in _LONG_FLAGS:
            return None
        explicit = bool(separator)
    if explicit and not attached:
        raise ValueError(f"{token}: the {flag} option has an empty value")
    return flag, attached or None


def _mount_options(tokens: Sequence[str]) -> Iterator[Tuple[str, str]]:
    """(flag, value) of every -v/--volume/--mount/--tmpfs option, whichever way it is written."""
    position = 0
    while position < len(tokens):
        found = _mount_flag(tokens[position])
        position += 1
        if found is None:
            continue
        flag, value = found
        if value is None:
            if position >= len(tokens):
                raise ValueError(f"{flag} at the end of the docker options has no value")
            value = tokens[position]
            position += 1
        yield flag, value


def _container_path(path: str, flag: str, spec: str) -> str:
    """A container path as docker compares them: absolute, without trailing or doubled slashes."""
    if not path.startswith("/"):
        raise ValueError(f"{flag} {spec!r}: the container path {path!r} is not absolute")
    normalized = posixpath.normpath(path)
    # normpath keeps a leading '//' (POSIX allows it a meaning); docker does not.
    return "/" + normalized.lstrip("/")


def volume_target(spec: str, flag: str = "-v") -> str:
    """The container path of a `-v` value: `/host:/ctr[:mode]`, `volume:/ctr[:mode]` or `/ctr` (anonymous)."""
    parts = spec.split(":")
    if len(parts) == 1:
        return _container_path(parts[0], flag, spec)
    if len(parts) > 3:
        raise ValueError(f"{flag} {spec!r}: too many ':' (expected host:container[:mode])")
    source, target = parts[0], parts[1]
    if not source:
        raise ValueError(f"{flag} {spec!r}: the host path or volume name is empty")
    if len(parts) == 3 and not parts[2]:
        raise ValueError(f"{flag} {spec!r}: the mode after the last ':' is empty")
    return _container_path(target, flag, spec)


def mount_target(spec: str, flag: str = "--mount") -> str:
    """The container path of a `--mount` value (`type=bind,source=/a,target=/b`; also `dst=`, `destination=`)."""
    try:
        fields = next(csv.reader([spec]))
    except (csv.Error, StopIteration) as error:
        raise ValueError(f"{flag} {spec!r}: not a comma-separated list of key=value fields ({error})") from None
    targets = []
    for field in fields:
        key, equals, value = field.partition("=")
        if not key.strip():
            raise ValueError(f"{flag} {spec!r}: empty field")
        if key.strip().lower() in _MOUNT_TARGET_KEYS:
            if not equals or not value:
                raise ValueError(f"{flag} {spec!r}: {key} has no value")
            targets.append(value)
    if len(targets) != 1:
        problem = "no target" if not targets else "more than one target"
        raise ValueError(f"{flag} {spec!r}: {problem} (give exactly one of target=, dst=, destination=)")
    return _container_path(targets[0], flag, spec)


def tmpfs_target(spec: str, flag: str = "--tmpfs") -> str:
    """The container path of a `--tmpfs` value (`/run` or `/run:rw,size=64m`)."""
    return _container_path(spec.split(":", 1)[0], flag, spec)


_TARGET_OF = {"-v": volume_target, "--volume": volume_target, "--mount": mount_target, "--tmpfs": tmpfs_target}


def mount_targets(docker_options: DockerOptions) -> Set[str]:
    """The container paths, normalized, that `docker_options` (argv list, or a string split with shlex) already mount,
    in every spelling (`-vX`, `--volume=X`, `--mount X`, `--tmpfs X`...); ValueError naming a malformed option."""
    return {_TARGET_OF[flag](value, flag) for flag, value in _mount_options(_option_tokens(docker_options))}


def _wanted_volume_specs(mounts) -> List[Tuple[str, str]]:
    """(`-v` value, its container path) for each wanted mount."""
    if isinstance(mounts, collections.abc.Mapping):
        specs = []
        for container_path, host_path in mounts.items():
            container_path, host_path = str(container_path), str(host_path)
            if not host_path:
                raise ValueError(f"docker_mounts {container_path!r}: the host path is empty")
            if ":" in container_path or ":" in host_path:
                raise ValueError(
                    f"docker_mounts {container_path!r}: {host_path!r}: a path with ':' cannot be given to -v; "
                    "mount it with --mount in additional_docker_run_options"
                )
            spec = f"{host_path}:{container_path}"
            specs.append((spec, volume_target(spec, "docker_mounts")))
        return specs
    if isinstance(mounts, (str, bytes)) or not isinstance(mounts, collections.abc.Sequence):
        raise ValueError(
            f"mounts must be a mapping {{container path: host path}} or a list of 'host:container[:mode]' "
            f"strings, got {mounts!r}"
        )
    specs = []
    for spec in mounts:
        if not isinstance(spec, str):
            raise ValueError(f"mount {spec!r} is not a 'host:container[:mode]' string")
        specs.append((spec, volume_target(spec, "mount")))
    return specs


def mount_args(mounts, docker_options: DockerOptions) -> List[str]:
    """`-v` arguments for ``mounts`` ({container path: host path}, MAD's `docker_mounts`, or `host:container[:mode]`
    strings) whose target neither `docker_options` nor an earlier mount already mounts; ValueError when malformed."""
    taken = mount_targets(docker_options)
    args: List[str] = []
    for spec, target in _wanted_volume_specs(mounts):
        if target in taken:
            continue
        taken.add(target)
        args += ["-v", spec]
    return args
