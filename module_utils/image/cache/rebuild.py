"""The rebuild fallback: a worker with no cache entry builds the image itself from rank 0's build manifest, and must
match rank 0's build fingerprint (builds are not reproducible, so not its image ID)."""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    ImageBuildError,
    ImageBuildPlan,
    ensure_image,
    image_build_plan,
    resolve_base_images,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_secrets import (
    BuildSecretError,
    check_build_args,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    CacheResult,
    ImageCacheError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_bases import DockerfileBaseError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL

_BUILD_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RebuildRecipe:
    """How a worker rebuilds the image when the cache has no entry: rank 0's build, checked by fingerprint."""

    def __init__(
        self,
        dockerfile: str,
        context: str,
        tag: str,
        build_fingerprint: str,
        build_args: Optional[Dict[str, str]] = None,
        log_dir: str = "",
        secrets_file: Optional[str] = None,
        buildkit_docker_cli: str = "docker",
    ):
        self.dockerfile = dockerfile
        self.context = context
        self.tag = tag
        self.build_fingerprint = build_fingerprint
        self.build_args = dict(build_args or {})
        self.log_dir = log_dir
        self.secrets_file = secrets_file or None
        self.buildkit_docker_cli = buildkit_docker_cli or "docker"

    @classmethod
    def from_dict(cls, data: dict) -> RebuildRecipe:
        """A recipe from the module's `rebuild` option; missing or malformed fields are refused by name."""
        missing = [key for key in ("dockerfile", "context", "tag", "build_fingerprint") if not data.get(key)]
        if missing:
            raise ImageCacheError(f"rebuild needs {', '.join(missing)} (from rank 0's build manifest)")
        if not data.get("log_dir"):
            # Never /tmp: a build step may print what it should not, and the log belongs with the job's results.
            raise ImageCacheError("rebuild needs log_dir, the node's dir in the attempt, for the build log")
        build_args = data.get("build_args") or {}
        if not isinstance(build_args, dict):
            raise ImageCacheError(
                f"rebuild.build_args must be a mapping of NAME: value, not {type(build_args).__name__}"
            )
        for name, value in build_args.items():
            if not _BUILD_ARG_NAME.match(str(name)):
                raise ImageCacheError(
                    f"rebuild.build_args: {name!r} is not a valid build arg name (letters, digits, _)"
                )
            if "\0" in str(value):
                raise ImageCacheError(f"rebuild.build_args: the value of {name} contains a NUL byte")
        try:
            check_build_args(build_args, "rebuild.build_args")
        except BuildSecretError as err:
            raise ImageCacheError(str(err)) from None
        return cls(
            str(data["dockerfile"]),
            str(data["context"]),
            str(data["tag"]),
            str(data["build_fingerprint"]),
            {str(name): str(value) for name, value in build_args.items()},
            data.get("log_dir"),
            data.get("secrets_file"),
            data.get("buildkit_docker_cli") or "docker",
        )

    def build_plan(self) -> ImageBuildPlan:
        """The recipe as the build stage's plan, so the worker builds exactly as rank 0 did."""
        try:
            check_build_args(self.build_args, "rebuild.build_args")
            return image_build_plan(
                {"name": self.tag},
                self.tag,
                self.dockerfile,
                self.context,
                self.build_args,
                self.log_dir,
                self.secrets_file,
            )
        except (BuildSecretError, DockerfileBaseError) as err:
            raise ImageCacheError(f"cannot rebuild {self.tag}: {err}") from None


def rebuild_image(cache: CacheDirectory, recipe: RebuildRecipe, check_mode: bool, started: float) -> CacheResult:
    """Build the image from the recipe: the fingerprint of this node's inputs is checked before (a missing base
    pulled first), the built image's label after."""
    for path, what in ((recipe.dockerfile, "Dockerfile"), (recipe.context, "build context")):
        if not os.path.exists(path):
            raise ImageCacheError(f"cannot rebuild {recipe.tag}: the {what} {path} does not exist on this node")
    env = dict(os.environ, DOCKER_HOST=cache.docker_host) if cache.docker_host else None
    try:
        plan, _ = resolve_base_images(recipe.build_plan(), env, pull=not check_mode)
        if plan is None:  # check mode, a base to pull: the fingerprint can be known only once it is here
            return CacheResult("rebuilt", True, None, None, 0, started)
        local = plan.fingerprint
        if local != recipe.build_fingerprint:
            bases = "".join(f", {reference} = {image_id}" for reference, image_id in sorted(plan.base_images.items()))
            raise ImageCacheError(
                f"refusing to rebuild {recipe.tag}: this node's Dockerfile, build args, context and base images"
                f"{bases} give build fingerprint {local}, rank 0 built {recipe.build_fingerprint}. The files differ "
                "on this node (shared storage out of date?), or its daemon holds another base under that name "
                "than rank 0's (the manifest's base_images): publish the image from rank 0 instead"
            )
        outcome = ensure_image(plan, env=env, check_mode=check_mode, buildkit_cli=recipe.buildkit_docker_cli)
    except ImageBuildError as err:
        raise ImageCacheError(f"rebuilding {recipe.tag} failed: {err}") from None
    if outcome.action == "reused":
        return CacheResult("already-present", False, outcome.image_id, None, 0, started, build_fingerprint=local)
    if outcome.action == "would_build":
        return CacheResult("rebuilt", True, None, None, 0, started, build_fingerprint=local)
    built = cache.inspect(recipe.tag) or {}
    built_fingerprint = ((built.get("Config") or {}).get("Labels") or {}).get(FINGERPRINT_LABEL)
    if built_fingerprint != recipe.build_fingerprint:
        raise ImageCacheError(
            f"the rebuilt {recipe.tag} carries build fingerprint {built_fingerprint!r}, "
            f"expected {recipe.build_fingerprint}"
        )
    return CacheResult(
        "rebuilt", True, built.get("Id"), None, 0, started, build_fingerprint=built_fingerprint, build_log=plan.log_file
    )
