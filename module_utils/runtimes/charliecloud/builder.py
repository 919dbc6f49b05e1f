"""Charliecloud's builder, as the build module asks its runtime for one (CharliecloudRuntime.builder): ch-image
builds each image on rank 0 into one squashfs in the shared image cache (build.py)."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import ImageBuilder
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_data import card_data, data_config
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud import NAME
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.build import (
    CharliecloudBuild,
    ensure_image,
    manifest_entry_fields,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class CharliecloudBuilder(ImageBuilder):
    """Builds or reuses each image's squashfs; remembers each one's file for its manifest entry."""

    def __init__(self, build: CharliecloudBuild):
        self.build = build
        self.squashfs_files: Dict[str, Optional[str]] = {}

    def ensure(self, plan, force_rebuild: bool, check_mode: bool):
        outcome, self.squashfs_files[plan.image_name] = ensure_image(
            self.build.cache, plan, self.build, force_rebuild, check_mode
        )
        return outcome

    def manifest_fields(self, outcome) -> Dict[str, object]:
        return manifest_entry_fields(outcome.plan, self.squashfs_files.get(outcome.plan.image_name))


def charliecloud_builder(params: Mapping, cards: Sequence[dict], zoo_root: str) -> CharliecloudBuilder:
    """The build the build module's options ask for (its `charliecloud` option), refusing what this runtime cannot
    do. Its images hold a mount point for every bind the run makes (a read-only squashfs cannot make one at run
    time): the context's docker_mounts and the cards' data."""
    if params.get("prebuilt_image"):
        raise UserError(
            "--use-image names a Docker image; container_runtime charliecloud builds its squashfs from the model's "
            "Dockerfile: drop --use-image (use_image), or use container_runtime docker"
        )
    if params.get("registry"):
        raise UserError(
            "registry mode hands images through a Docker registry; container_runtime charliecloud hands one "
            "squashfs through the shared image cache instead: drop --registry (registry), or use container_runtime "
            "docker"
        )
    options = params.get(NAME)
    if not options:
        raise UserError("container_runtime charliecloud needs the charliecloud option (its cache_dir at least)")
    cache = CacheDirectory(resolve_cache_dir(options["cache_dir"]))
    entries = data_config(zoo_root, params.get("context") or {})
    data_targets = [mount.split(":")[1] for card in cards for mount in card_data(card, entries).get("mounts", [])]
    mount_points = list(options["mount_points"]) + data_targets
    return CharliecloudBuilder(CharliecloudBuild(cache, options["storage_dir"], options["bases"], mount_points))
