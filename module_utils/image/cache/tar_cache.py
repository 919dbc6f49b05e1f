"""The shared image tar cache: rank 0 publishes the image it built, every worker loads it, nobody half-loads it.

`ImageCache` is what the image_cache module (and a benchmark or a test) holds: one cache directory seen through
one Docker daemon, and the three things done to it. Each lives in its own file:

* entries - the directory's layout, its entries and commit markers, the checks, the atomic commit
  and `prune`;
* publish - `publish`: `docker save` into the cache, committed tar first, marker last;
* load - `load`: wait for the marker, stream the tar into `docker load`, verified in one pass;
* rebuild - the fallback of `load` when there is no entry: build from rank 0's manifest.
"""

from __future__ import annotations

from typing import Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    DEFAULT_MARKER_WAIT,
    CacheDirectory,
    CacheResult,
    prune_entries,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import RebuildRecipe


class ImageCache(CacheDirectory):
    """One cache directory, seen through one Docker daemon (the CLI's default, or `docker_host`)."""

    def publish(self, image: str, check_mode: bool = False, teach: bool = True) -> CacheResult:
        """Save `image` into the cache as a committed entry unless it is there (publish.py)."""
        return publish_image(self, image, check_mode=check_mode, teach=teach)

    def load(
        self,
        image_id: str,
        image: Optional[str] = None,
        marker_wait: float = DEFAULT_MARKER_WAIT,
        rebuild: Optional[RebuildRecipe] = None,
        check_mode: bool = False,
    ) -> CacheResult:
        """Make this node's daemon hold `image_id`, from the cache or by `rebuild` (load.py)."""
        return load_image(self, image_id, image=image, marker_wait=marker_wait, rebuild=rebuild, check_mode=check_mode)

    def prune(
        self, keep: int, max_age_days: float, check_mode: bool = False, now: Optional[float] = None
    ) -> CacheResult:
        """Remove expired entries beyond the newest `keep`, and orphaned files (entries.py)."""
        return prune_entries(self, keep, max_age_days, check_mode=check_mode, now=now)
