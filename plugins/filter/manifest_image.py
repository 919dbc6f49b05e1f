"""Filter: the image reference every node runs, as the job's build manifest names it (the build stage)."""

from ansible.errors import AnsibleFilterError

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import image_provenance
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    ImageNameError,
    is_registry_reference,
    prebuilt_image_reference,
)


def manifest_image_reference(manifest, registry_mode=False, index=0):
    """What ``docker run`` is given for the manifest's one model (a sweep run's: its ``index``-th, from 0), before
    rank 0 pins it in registry mode: the local image name (``built_models`` key), or in registry mode the digest
    reference rank 0's push printed, else the pushed tag (a manifest MAD wrote); None when it names neither."""
    if not isinstance(manifest, dict) or not manifest.get("built_models") or not manifest.get("built_images"):
        raise AnsibleFilterError(
            "the build manifest names no built_models or built_images: give a manifest with "
            "the model's image (build_manifest.json as build_images or MAD writes it)"
        )
    index = int(index)
    if not 0 <= index < len(manifest["built_models"]):
        raise AnsibleFilterError(
            f"the build manifest has {len(manifest['built_models'])} images, no image {index + 1}: a sweep run's index "
            "counts the images of the manifest its first run built"
        )
    if not registry_mode:
        return list(manifest["built_models"])[index]
    built_image = list(manifest["built_images"].values())[index] or {}
    return built_image.get("registry_image_by_digest") or built_image.get("registry_image") or None


def manifest_image_provenance(manifest, index=0):
    """What the perf rows say of the manifest's ``index``-th image (docker_image, base_docker, docker_sha,
    build_duration, git_commit): its built_images entry's."""
    images = list((manifest or {}).get("built_images", {}).values())
    return image_provenance(images[int(index)] if 0 <= int(index) < len(images) else {})


def image_in_registry(use_image):
    """Whether a prebuilt image (``use_image``) comes from a registry (a host or a digest); False for none."""
    if not use_image:
        return False
    try:
        return is_registry_reference(prebuilt_image_reference(use_image))
    except ImageNameError as error:
        raise AnsibleFilterError(str(error)) from None


class FilterModule:
    def filters(self):
        return {
            "manifest_image_reference": manifest_image_reference,
            "manifest_image_provenance": manifest_image_provenance,
            "image_in_registry": image_in_registry,
        }
