"""Registry mode: every node runs the image rank 0 pushed by its digest, never a tag a later push may move."""

from __future__ import annotations

import re
from collections import namedtuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    image_inspect,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    digest_reference,
    is_digest_reference,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

DEFAULT_PULL_TIMEOUT = 3600.0

# `docker push` ends with `<tag>: digest: sha256:<hex> size: <bytes>`; `docker pull` prints `Digest: sha256:<hex>`.
_PUSHED_DIGEST = re.compile(r"digest: (sha256:[0-9a-f]{64}) size: \d+")
_PULLED_DIGEST = re.compile(r"^Digest: (sha256:[0-9a-f]{64})\s*$", re.MULTILINE)

PulledImage = namedtuple("PulledImage", "reference image_id action")
PulledImage.__doc__ = """What `pull_image` did: the image by digest and its ID (None where check mode did not pull),
and `already-present`, `pulled`, `up-to-date` (a tag whose image the node had) or `would-pull`."""


class ImageRegistryError(UserError):
    """A pull, or a push's digest, that went wrong, with what the user needs to check."""


def pushed_digest(push_output: str) -> str | None:
    """The digest `docker push` reported for the image it pushed (its last `digest: ... size:` line), or None."""
    found = _PUSHED_DIGEST.findall(push_output)
    return found[-1] if found else None


def pulled_digest(pull_output: str) -> str | None:
    """The digest `docker pull` reported (`Digest: sha256:...`), or None."""
    found = _PULLED_DIGEST.findall(pull_output)
    return found[-1] if found else None


def _inspected_id(reference: str, host) -> str | None:
    try:
        inspected = image_inspect(reference, host=host)
    except DockerError as error:
        raise ImageRegistryError(str(error)) from None
    return inspected.get("Id") if inspected else None


def pull_image(
    reference: str, host=None, timeout: float = DEFAULT_PULL_TIMEOUT, check_mode: bool = False, login_env=None
) -> PulledImage:
    """Make this node's daemon hold `reference` (by digest: unless it does; by tag: always pulled) and say which
    image that is, by digest and by ID. `login_env` is registry_credentials.logged_in's."""
    by_digest = is_digest_reference(reference)
    if by_digest:
        present = _inspected_id(reference, host)
        if present:
            return PulledImage(reference, present, "already-present")
    if check_mode:
        return PulledImage(reference if by_digest else None, None, "would-pull")
    try:
        completed = run_docker(["pull", reference], timeout=timeout, host=host, check=False, extra_env=login_env)
    except DockerError as error:
        raise ImageRegistryError(str(error)) from None
    if completed.returncode != 0:
        raise ImageRegistryError(
            f"docker pull {reference} failed (exit {completed.returncode}): {completed.stderr.strip()[-1500:]}. "
            "Check that this node reaches the registry and, if it needs a login, that the job has its "
            "credentials (credentials_file, `--credentials credential.json`)"
        )
    if by_digest:
        pinned = reference
    else:
        digest = pulled_digest(completed.stdout)
        if digest is None:
            raise ImageRegistryError(
                f"docker pull {reference} printed no digest, so the workers could not be given one; "
                f"its output: {completed.stdout.strip()[-500:]}"
            )
        pinned = digest_reference(reference, digest)
    image_id = _inspected_id(pinned, host)
    if image_id is None:
        raise ImageRegistryError(f"docker pull {reference} succeeded but this node's daemon has no image {pinned}")
    action = "pulled" if by_digest or "Downloaded newer image" in completed.stdout else "up-to-date"
    return PulledImage(pinned, image_id, action)
