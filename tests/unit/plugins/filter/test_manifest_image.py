"""The image reference every node runs, taken from the job's build manifest by mode."""

import pytest
from ansible.errors import AnsibleFilterError

from plugins.filter.manifest_image import manifest_image_reference

DIGEST_REFERENCE = "127.0.0.1:17500/bench/ci-dummy_dummy@sha256:" + "d" * 64


def _manifest(**image_fields):
    return {
        "built_models": {"ci-dummy_dummy": {"name": "dummy"}},
        "built_images": {"ci-dummy_dummy": {"image_id": "sha256:" + "a" * 64, **image_fields}},
    }


def test_tar_cache_mode_runs_the_local_image_name():
    assert (
        manifest_image_reference(_manifest(registry_image="127.0.0.1:17500/bench:ci-dummy_dummy")) == "ci-dummy_dummy"
    )


def test_registry_mode_runs_the_digest_rank_0s_push_printed():
    manifest = _manifest(
        registry_image="127.0.0.1:17500/bench:ci-dummy_dummy", registry_image_by_digest=DIGEST_REFERENCE
    )
    assert manifest_image_reference(manifest, True) == DIGEST_REFERENCE


def test_registry_mode_with_a_mad_manifest_naming_only_the_tag_runs_the_tag_for_rank_0_to_pin():
    assert (
        manifest_image_reference(_manifest(registry_image="docker.io/org/bench:ci-dummy_dummy"), True)
        == "docker.io/org/bench:ci-dummy_dummy"
    )


@pytest.mark.parametrize("fields", [{}, {"registry_image": "", "registry_image_by_digest": None}])
def test_registry_mode_without_a_registry_image_gives_none_for_the_stage_to_refuse(fields):
    assert manifest_image_reference(_manifest(**fields), True) is None


@pytest.mark.parametrize("manifest", [{}, {"built_models": {}, "built_images": {}}, None])
def test_a_manifest_without_images_is_an_error_saying_what_it_lacks(manifest):
    with pytest.raises(AnsibleFilterError, match="no built_models or built_images"):
        manifest_image_reference(manifest)
