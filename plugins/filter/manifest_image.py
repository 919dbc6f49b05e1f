"""Filter: the image reference every node runs, as the job's build manifest names it (the build stage)."""

from ansible.errors import AnsibleFilterError


def manifest_image_reference(manifest, registry_mode=False):
    """What ``docker run`` is given for the manifest's one model, before rank 0 pins it in registry mode.

    Tar-cache mode: the local image name (the manifest's ``built_models`` key). Registry mode: the digest
    reference rank 0's push printed (``registry_image_by_digest``), else the pushed tag (``registry_image``, a
    manifest MAD wrote), which rank 0 then pins to a digest; None when the manifest names neither (the stage
    refuses that with its fix).
    """
    if not isinstance(manifest, dict) or not manifest.get("built_models") or not manifest.get("built_images"):
        raise AnsibleFilterError(
            "the build manifest names no built_models or built_images: give a manifest with "
            "the model's image (build_manifest.json as build_images or MAD writes it)"
        )
    if not registry_mode:
        return next(iter(manifest["built_models"]))
    built_image = next(iter(manifest["built_images"].values())) or {}
    return built_image.get("registry_image_by_digest") or built_image.get("registry_image") or None


class FilterModule:
    def filters(self):
        return {"manifest_image_reference": manifest_image_reference}
