"""A prebuilt image (`--use-image IMAGE`, as MAD's): the job's manifest for it, written instead of a build."""

from __future__ import annotations

import socket

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, image_inspect
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    new_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    is_digest_reference,
    is_registry_reference,
    prebuilt_image_reference,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class PrebuiltImageError(UserError):
    """A prebuilt image that cannot be run: not on rank 0's daemon, or a selection of other than one model."""


def one_card(cards: list, tags, image: str) -> dict:
    """The one card `tags` selected for `image`; several or none is an error naming them."""
    if len(cards) != 1:
        names = ", ".join(card["name"] for card in cards) or "none"
        raise ManifestError(
            f"--use-image {image} runs one model card, but tags {list(tags)} select {len(cards)} ({names}): "
            "narrow the tags to the model the image runs"
        )
    return cards[0]


def local_image_id(image: str, node=None, host=None) -> str:
    """The ID of the local image `image` on this node's daemon; PrebuiltImageError naming the image and node."""
    node = node or socket.gethostname()
    try:
        inspected = image_inspect(image, host=host)
    except DockerError as error:
        raise PrebuiltImageError(f"cannot inspect --use-image {image} on {node}: {error}") from None
    if inspected is None:
        raise PrebuiltImageError(
            f"--use-image {image}: {node} (rank 0) has no image {image} on its Docker daemon. A local image "
            f"must be on rank 0, which hands it to the other nodes through the shared tar cache: `docker load` or "
            f"`docker pull` it on {node} first, or give a registry reference (host/repository:tag or @sha256:...) "
            "that every node pulls"
        )
    return inspected["Id"]


def prebuilt_image_entry(card: dict, image: str, gpu_vendor: str = "", image_id=None) -> dict:
    """A `built_images` entry for a prebuilt image (MAD's keys; nothing was built, so no Dockerfile or log)."""
    entry = {
        "model": card["name"],
        "docker_image": image,
        "dockerfile": "",
        "base_docker": "",
        "docker_sha": "",
        "build_duration": 0,
        "build_command": "",
        "log_file": "",
        "gpu_vendor": gpu_vendor,
        "image_id": image_id,
        "prebuilt": True,
    }
    if is_registry_reference(image):
        entry["registry_image"] = image
        if is_digest_reference(image):
            entry["registry_image_by_digest"] = image
    return entry


def prebuilt_manifest(card: dict, image: str, run_context: dict, deployment_config=None) -> dict:
    """The job's build manifest for `image` running `card`; a local image is inspected on this node first."""
    image = prebuilt_image_reference(image)
    image_id = None if is_registry_reference(image) else local_image_id(image)
    entry = prebuilt_image_entry(card, image, str(run_context.get("gpu_vendor") or ""), image_id)
    return new_manifest({image: entry}, {image: card}, run_context, deployment_config)
