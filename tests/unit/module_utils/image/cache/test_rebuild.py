"""The rebuild fallback over a base image: a worker rebuilds only over the base rank 0 built over (its ID, not its
name), against a real (private) Docker daemon standing for the worker's."""

import uuid

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import image_id
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    ImageCacheError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import RebuildRecipe
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import build_fingerprint
from tests.support.dockerd import build_busybox_image

UNPUBLISHED_ID = "sha256:" + "cd" * 32


@pytest.fixture
def base(private_dockerd):
    """(tag, ID) of a base of this test's own on the worker's daemon, holding 111 in /base-version."""
    tag = f"slurm-multi-test/rebuild-base:{uuid.uuid4().hex[:8]}"
    yield tag, build_busybox_image(private_dockerd, tag, "RUN echo 111 > /base-version\n")
    private_dockerd.docker("rmi", "-f", tag, check=False)


@pytest.fixture
def worker(private_dockerd, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    return CacheDirectory(str(cache_dir), docker_host=private_dockerd.host)


def recipe_over(base_tag, rank0_base_id, tmp_path):
    """Rank 0's recipe for an image over `base_tag`, which rank 0's daemon resolved to `rank0_base_id`."""
    context = tmp_path / "context"
    context.mkdir()
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(f"ARG BASE_DOCKER={base_tag}\nFROM $BASE_DOCKER\n")
    fingerprint = build_fingerprint(dockerfile, {}, str(context), {base_tag: rank0_base_id})
    tag = f"slurm-multi-test/rebuilt-over-base:{uuid.uuid4().hex[:8]}"
    return RebuildRecipe(str(dockerfile), str(context), tag, fingerprint, log_dir=str(tmp_path / "logs"))


def test_a_worker_holding_rank0s_base_rebuilds_over_it(private_dockerd, worker, base, tmp_path):
    recipe = recipe_over(*base, tmp_path)
    result = load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)
    assert (result.action_taken, result.image_id) == ("rebuilt", image_id(recipe.tag, host=private_dockerd.host))
    private_dockerd.docker("rmi", "-f", recipe.tag, check=False)


def test_a_worker_holding_another_base_under_rank0s_name_refuses_to_rebuild(private_dockerd, worker, base, tmp_path):
    tag, rank0_id = base
    worker_id = build_busybox_image(private_dockerd, tag, "RUN echo 222 > /base-version\n")  # moved on this node
    recipe = recipe_over(tag, rank0_id, tmp_path)
    with pytest.raises(ImageCacheError, match=rf"refusing to rebuild .* base images, {tag} = {worker_id} give"):
        load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)
    assert image_id(recipe.tag, host=private_dockerd.host) is None
