"""Names of images: MAD's local image names, the build fingerprint label, and `--registry` normalized to a fully
qualified reference (`rocm/x` -> `docker.io/rocm/x`)."""

from __future__ import annotations

import hashlib
import os
import re

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import is_secret_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

FINGERPRINT_LABEL = "slurm-multi.build-fingerprint"
MAX_LOCAL_NAME_LENGTH = 128
DOCKER_HUB = "docker.io"

# Bytes of build context read for the fingerprint; beyond it, files count by path, size and mtime only.
CONTEXT_CONTENT_HASH_LIMIT = 256 * 1024 * 1024

_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_HOST = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]{1,5})?$"
)
_SEPARATOR_RUN = re.compile(r"[._-]+")

REGISTRY_EXAMPLES = (
    "rocm/pytorch-private (Docker Hub), docker.io/rocm/pytorch-private, ghcr.io/myorg/myrepo, "
    "quay.io/myorg/myrepo, nvcr.io/myorg/myrepo, registry.example.com:5000/team/repo, localhost:5000/myrepo"
)


class ImageNameError(UserError):
    """A name that Docker would refuse, with what to use instead."""


def dockerfile_stem(dockerfile_path) -> str:
    """The Dockerfile's file name without `.Dockerfile` (`dummy.ubuntu.amd`), as MAD names images and logs."""
    name = os.path.basename(str(dockerfile_path))
    return name[: -len(".Dockerfile")] if name.endswith(".Dockerfile") else name


def _valid_separator(run: str) -> bool:
    return run in (".", "_", "__") or set(run) == {"-"}


def docker_safe_name(raw: str) -> str:
    """`raw` as a valid one-component Docker repository name (also a valid tag): lowercased, what Docker refuses made
    `_`, outer separators gone; past 128 characters cut, with a hash of the full name appended to keep it distinct."""
    name = re.sub(r"[^a-z0-9._-]", "_", str(raw).lower())
    name = _SEPARATOR_RUN.sub(lambda match: match.group(0) if _valid_separator(match.group(0)) else "_", name)
    name = name.strip("._-")
    if not name:
        raise ImageNameError(f"{raw!r} has no letters or digits to make an image name from")
    if len(name) > MAX_LOCAL_NAME_LENGTH:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = name[: MAX_LOCAL_NAME_LENGTH - len(digest) - 1].rstrip("._-") + "-" + digest
    return name


def local_image_name(model_name: str, dockerfile_path) -> str:
    """MAD's local image name for a model card built from a Dockerfile: `ci-<model>_<dockerfile stem>`."""
    return docker_safe_name("ci-" + str(model_name).replace("/", "_") + "_" + dockerfile_stem(dockerfile_path))


def _hash_build_context(digest, context_dir) -> None:
    budget = CONTEXT_CONTENT_HASH_LIMIT
    for root, dirs, files in os.walk(context_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, context_dir).replace(os.sep, "/")
            if os.path.islink(path):
                digest.update(f"link\0{relative}\0{os.readlink(path)}\0".encode())
                continue
            status = os.stat(path)
            if status.st_size <= budget:
                budget -= status.st_size
                content = hashlib.sha256()
                with open(path, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        content.update(block)
                digest.update(f"file\0{relative}\0{content.hexdigest()}\0".encode())
            else:
                digest.update(f"stat\0{relative}\0{status.st_size}\0{status.st_mtime_ns}\0".encode())


def build_fingerprint(dockerfile_path, build_args, context_dir=None, base_images=None) -> str:
    """The sha256 (hex) of what an image is built from, stored as the `FINGERPRINT_LABEL` label: the Dockerfile, the
    build args, the build context's files (contents up to `CONTEXT_CONTENT_HASH_LIMIT` bytes, the rest by size and
    mtime) and `base_images` ({reference: image ID}). `MAD_SECRETS_*` args count by name only: a new token must not
    force a rebuild, and a hash of a secret does not belong in an image label."""
    digest = hashlib.sha256()
    with open(dockerfile_path, "rb") as handle:
        digest.update(b"dockerfile\0" + handle.read() + b"\0")
    for name in sorted(build_args or {}):
        value = "<secret>" if is_secret_name(name) else str(build_args[name])
        digest.update(f"arg\0{name}\0{value}\0".encode())
    if context_dir is not None:
        _hash_build_context(digest, context_dir)
    for reference in sorted(base_images or {}):
        digest.update(f"base\0{reference}\0{base_images[reference]}\0".encode())
    return digest.hexdigest()


def _registry_error(value, problem) -> ImageNameError:
    return ImageNameError(f"invalid registry {value!r}: {problem}. Valid examples: {REGISTRY_EXAMPLES}")


def _is_host(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


def _one_word(value, error, scheme_problem: str) -> str:
    """`value` stripped, or `error(value, why)` raised: empty, holding whitespace, or a URL."""
    if not isinstance(value, str) or not value.strip():
        raise error(value, "it is empty")
    word = value.strip()
    if re.search(r"\s", word):
        raise error(value, "it contains whitespace")
    if "://" in word:
        raise error(value, scheme_problem)
    return word


def normalize_registry(value) -> str:
    """The registry/repository the user gave as `--registry`, fully qualified; refused: empty, whitespace, `@`, a
    URL scheme, a tag (the tag is the model image's name), invalid path components, `docker.io` without a namespace."""
    registry = _one_word(value, _registry_error, "give the registry without a URL scheme (no http:// or https://)")
    if "@" in registry:
        raise _registry_error(value, "'@' is not allowed (digests cannot be pushed to)")
    components = registry.rstrip("/").split("/")
    if _is_host(components[0]):
        host, path = components[0], components[1:]
        if not _HOST.match(host):
            raise _registry_error(value, f"{host!r} is not a valid registry host[:port]")
    else:
        host, path = DOCKER_HUB, components
    for component in path:
        if ":" in component:
            raise _registry_error(value, "a tag is not allowed: each model image is pushed with its own tag")
        if component != component.lower():
            raise _registry_error(value, f"repository path {component!r} must be lowercase")
        if not _PATH_COMPONENT.match(component):
            raise _registry_error(
                value, f"{component!r} is not a valid repository path component (lowercase letters, digits, . _ -)"
            )
    if host.lower() in (DOCKER_HUB, "index.docker.io", "registry-1.docker.io"):
        host = DOCKER_HUB
        if not path:
            raise _registry_error(value, "Docker Hub needs a namespace, e.g. docker.io/myorg")
    return "/".join([host] + path)


def registry_image_name(normalized_registry: str, local_image: str) -> str:
    """The reference a local image is pushed as: `<repository>:<local name>`, `docker.io/<namespace>/<local name>`
    for a Docker Hub namespace, `<host>/<local name>` for a bare registry host."""
    host, _, path = normalized_registry.partition("/")
    if not path:
        return f"{host}/{local_image}"
    if host == DOCKER_HUB and "/" not in path:
        return f"{normalized_registry}/{local_image}"
    return f"{normalized_registry}:{local_image}"


_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def repository_of(reference: str) -> str:
    """The repository of an image reference, without its tag or digest (a `:` before the last `/` is a port)."""
    name = reference.split("@", 1)[0]
    head, slash, last = name.rpartition("/")
    return head + slash + last.split(":", 1)[0]


def is_digest_reference(reference: str) -> bool:
    """Whether `reference` names an image by its content (`repo@sha256:<64 hex>`): no push can move it."""
    _, at, digest = reference.partition("@")
    return bool(at) and bool(_DIGEST.match(digest))


def digest_reference(reference: str, digest: str) -> str:
    """`<repository of reference>@<digest>`: what workers pull, so that a tag moved meanwhile cannot change it."""
    if not _DIGEST.match(digest or ""):
        raise ImageNameError(f"{digest!r} is not an image digest (expected sha256: and 64 hex digits)")
    return f"{repository_of(reference)}@{digest}"


_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_IMAGE_ID = re.compile(r"^(?:sha256:)?[0-9a-f]{12,64}$")


def _image_error(value, problem) -> ImageNameError:
    return ImageNameError(
        f"--use-image {value!r} is not a Docker image reference: {problem}. Give [host[:port]/]path[:tag][@digest], "
        "e.g. my-image:latest (a local image of rank 0's daemon), 127.0.0.1:5000/team/bench:v1 or "
        "ghcr.io/org/repo@sha256:<64 hex> (a registry image)"
    )


def prebuilt_image_reference(value) -> str:
    """`value` (`--use-image`) checked to be a Docker image reference, as given; ImageNameError saying why not (an
    image ID too: no other node can get it by that)."""
    reference = _one_word(value, _image_error, "no URL scheme (http:// or https://)")
    if _IMAGE_ID.match(reference) and (reference.startswith("sha256:") or len(reference) == 64):
        raise _image_error(value, "an image ID names no image another node can get: `docker tag` it with a name")
    name, at, digest = reference.partition("@")
    if at and not _DIGEST.match(digest):
        raise _image_error(value, f"{digest!r} is not a digest (sha256: and 64 hex digits)")
    components = name.split("/")
    if len(components) > 1 and _is_host(components[0]):
        if not _HOST.match(components[0]):
            raise _image_error(value, f"{components[0]!r} is not a valid registry host[:port]")
        components = components[1:]
    last, colon, tag = components[-1].partition(":")
    if colon and not _TAG.match(tag):
        raise _image_error(value, f"tag {tag!r} is not valid (letters, digits, _ . -; at most 128)")
    for component in components[:-1] + [last]:
        if not _PATH_COMPONENT.match(component):
            problem = (
                "uppercase is not allowed" if component != component.lower() else "lowercase letters, digits, . _ -"
            )
            raise _image_error(value, f"path component {component!r}: {problem}")
    return reference


def is_registry_reference(reference: str) -> bool:
    """Whether a prebuilt image comes from a registry: it names a registry host or a digest (`rocm/pytorch:latest`
    is a local name; `docker.io/rocm/pytorch` is Docker Hub's)."""
    name = reference.partition("@")[0]
    first, slash, _ = name.partition("/")
    return "@" in reference or bool(slash and _is_host(first))
