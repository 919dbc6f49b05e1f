"""Filter: how a worker rebuilds rank 0's image when the shared cache has no tar (image_cache's `rebuild`)."""

import os

from ansible.errors import AnsibleFilterError


def rebuild_spec(built_image, tag, log_dir, build_args=None, secrets_file="", buildkit_docker_cli="docker"):
    """The image_cache module's ``rebuild`` option for a manifest's ``built_images`` entry, the build log in
    ``log_dir``. The context is the Dockerfile's directory, as MAD builds it; the result is checked by the entry's
    build fingerprint (Docker builds are not reproducible, so never by its ID)."""
    if not isinstance(built_image, dict):
        raise AnsibleFilterError(
            f"a manifest's built_images entry must be a JSON object, not {type(built_image).__name__}"
        )
    missing = [key for key in ("dockerfile", "build_fingerprint") if not built_image.get(key)]
    if missing:
        raise AnsibleFilterError(
            f"the manifest's entry for {tag} has no {' or '.join(missing)}, which the rebuild fallback needs (it "
            f"builds the Dockerfile and checks the result by its build fingerprint): use a manifest slurm-multi "
            f"built, or set rebuild_fallback to false."
        )
    if build_args is not None and not isinstance(build_args, dict):
        raise AnsibleFilterError(
            f"run_context.docker_build_arg must be a JSON object of NAME: value, not {type(build_args).__name__}"
        )
    dockerfile = str(built_image["dockerfile"])
    return {
        "dockerfile": dockerfile,
        "context": os.path.dirname(dockerfile),
        "tag": str(tag),
        "log_dir": str(log_dir),
        "build_fingerprint": built_image["build_fingerprint"],
        "build_args": dict(build_args or {}),
        "secrets_file": secrets_file or "",
        "buildkit_docker_cli": buildkit_docker_cli,
    }


class FilterModule:
    def filters(self):
        return {"rebuild_spec": rebuild_spec}
