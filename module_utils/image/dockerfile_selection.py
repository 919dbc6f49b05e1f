"""Which Dockerfiles build a model card, as MAD chooses them, and the build args and context they get."""

from __future__ import annotations

import ast
import glob
import os
import re

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

CONTEXT_MARKER = "# CONTEXT"
CONTEXT_SEARCH_LINES = 5
DEFAULT_DOCKER_CONTEXT = "docker"


class DockerfileSelectionError(UserError):
    """No usable Dockerfile for a model card, or a Dockerfile whose CONTEXT line cannot be read."""


def read_dockerfile_context(dockerfile_path) -> dict:
    """The `# CONTEXT {...}` dict (a Python literal, read as data only) from a Dockerfile's first lines, or {}."""
    try:
        with open(dockerfile_path, encoding="utf-8", errors="replace") as handle:
            head = [handle.readline() for _ in range(CONTEXT_SEARCH_LINES)]
    except OSError as error:
        raise DockerfileSelectionError(f"cannot read Dockerfile {dockerfile_path}: {error.strerror}") from None
    for number, line in enumerate(head, start=1):
        stripped = line.strip()
        if not stripped.startswith(CONTEXT_MARKER):
            continue
        literal = stripped[len(CONTEXT_MARKER) :].strip()
        try:
            context = ast.literal_eval(literal) if literal else {}
        except (ValueError, SyntaxError) as error:
            raise DockerfileSelectionError(
                f"{dockerfile_path}, line {number}: the CONTEXT line is not a dict literal ({error}); "
                "expected e.g. # CONTEXT {'gpu_vendor': 'AMD', 'guest_os': 'UBUNTU'}"
            ) from None
        if not isinstance(context, dict):
            raise DockerfileSelectionError(
                f"{dockerfile_path}, line {number}: the CONTEXT line must hold a dict, not a {type(context).__name__}"
            )
        return context
    return {}


def context_fits(dockerfile_context: dict, run_context: dict) -> bool:
    """True when every key the Dockerfile's CONTEXT shares with the run context has the same value (MAD's rule)."""
    return all(run_context[key] == value for key, value in dockerfile_context.items() if key in run_context)


def candidate_dockerfiles(zoo_root, dockerfile_prefix) -> list:
    """The Dockerfiles a card's `dockerfile` prefix names, sorted: `<prefix>.*Dockerfile`, else the prefix itself."""
    prefix = os.path.join(str(zoo_root), str(dockerfile_prefix))
    matches = sorted(
        path for path in glob.glob(glob.escape(prefix) + ".*") if path.endswith("Dockerfile") and os.path.isfile(path)
    )
    if not matches and os.path.isfile(prefix):
        matches = [prefix]
    return matches


def select_dockerfiles(zoo_root, model_card: dict, run_context: dict) -> list:
    """The Dockerfiles (absolute paths, sorted) to build `model_card` with in `run_context`; an error naming the
    candidates and their CONTEXT lines when none fits."""
    name = model_card.get("name", "?")
    prefix = model_card.get("dockerfile")
    if not isinstance(prefix, str) or not prefix.strip():
        raise DockerfileSelectionError(f"model {name!r} has no 'dockerfile' path prefix (e.g. \"docker/{name}\")")
    candidates = candidate_dockerfiles(zoo_root, prefix)
    if not candidates:
        raise DockerfileSelectionError(
            f"model {name!r}: no Dockerfile matches {prefix}.*Dockerfile under {zoo_root} "
            f"(expected e.g. {prefix}.ubuntu.amd.Dockerfile)"
        )
    contexts = [(path, read_dockerfile_context(path)) for path in candidates]
    chosen = [os.path.abspath(path) for path, context in contexts if context_fits(context, run_context)]
    if not chosen:
        wanted = {key: run_context[key] for key in sorted({k for _, c in contexts for k in c}) if key in run_context}
        listing = "; ".join(f"{os.path.relpath(path, str(zoo_root))} {context}" for path, context in contexts)
        raise DockerfileSelectionError(
            f"model {name!r}: no Dockerfile fits the run context {wanted}. Candidates and their CONTEXT: {listing}. "
            "Set gpu_vendor/guest_os in the additional context to one of those, or add a fitting Dockerfile"
        )
    return chosen


def build_context_dir(zoo_root, model_card: dict) -> str:
    """The directory sent to `docker build` for a card: its `dockercontext`, else the zoo's `docker/` (MAD's rule)."""
    relative = model_card.get("dockercontext") or DEFAULT_DOCKER_CONTEXT
    path = os.path.abspath(os.path.join(str(zoo_root), str(relative)))
    if not os.path.isdir(path):
        raise DockerfileSelectionError(
            f"model {model_card.get('name', '?')!r}: the build context {path} is not a directory "
            "(the zoo's docker/ directory, or the card's 'dockercontext')"
        )
    return path


_BUILD_ARG_NAME = re.compile(r"^[^=\s]+$")


def build_args_from_context(run_context: dict) -> dict:
    """The run context's `docker_build_arg` as `{name: str value}`; bad names and non-scalar values refused."""
    build_args = run_context.get("docker_build_arg") or {}
    if not isinstance(build_args, dict):
        raise DockerfileSelectionError(
            f"docker_build_arg must be an object of NAME: value, not {type(build_args).__name__}: "
            'e.g. {"BASE_DOCKER": "rocm/pytorch:latest"}'
        )
    result = {}
    for name, value in build_args.items():
        if not isinstance(name, str) or not _BUILD_ARG_NAME.match(name):
            raise DockerfileSelectionError(f"docker_build_arg name {name!r} is invalid (no '=' or whitespace)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DockerfileSelectionError(
                f"docker_build_arg {name} must be a string or a number, not {type(value).__name__}"
            )
        result[name] = str(value)
    return result
