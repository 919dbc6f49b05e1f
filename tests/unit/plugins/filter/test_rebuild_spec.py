"""The rebuild spec a worker hands image_cache: built from the manifest's entry for rank 0's image."""

import pytest
from ansible.errors import AnsibleFilterError

from plugins.filter.rebuild_spec import rebuild_spec

ENTRY = {
    "dockerfile": "/models/docker/dummy.Dockerfile",
    "build_fingerprint": "f" * 64,
    "image_id": "sha256:" + "a" * 64,
    "model": "dummy",
}


def test_the_spec_builds_the_dockerfile_in_its_directory_under_rank_0s_name():
    spec = rebuild_spec(
        ENTRY,
        "ci-dummy_dummy",
        "/results/42/attempt-0/nodes/node2",
        {"BASE_DOCKER": "busybox"},
        "/run/secrets.env",
        "docker-buildx",
    )
    assert spec == {
        "dockerfile": "/models/docker/dummy.Dockerfile",
        "context": "/models/docker",
        "tag": "ci-dummy_dummy",
        "log_dir": "/results/42/attempt-0/nodes/node2",
        "build_fingerprint": "f" * 64,
        "build_args": {"BASE_DOCKER": "busybox"},
        "secrets_file": "/run/secrets.env",
        "buildkit_docker_cli": "docker-buildx",
    }


def test_no_build_args_and_no_secrets_file_give_empty_ones():
    spec = rebuild_spec(ENTRY, "ci-dummy_dummy", "/results")
    assert (spec["build_args"], spec["secrets_file"], spec["buildkit_docker_cli"]) == ({}, "", "docker")


@pytest.mark.parametrize("key", ["dockerfile", "build_fingerprint"])
def test_an_entry_without_what_the_rebuild_needs_is_an_error_naming_it_and_the_fix(key):
    entry = {name: value for name, value in ENTRY.items() if name != key}
    with pytest.raises(AnsibleFilterError) as error:
        rebuild_spec(entry, "ci-dummy_dummy", "/results")
    assert key in str(error.value) and "ci-dummy_dummy" in str(error.value)
    assert "rebuild_fallback" in str(error.value)


def test_build_args_that_are_not_a_mapping_are_an_error():
    with pytest.raises(AnsibleFilterError, match="docker_build_arg must be a JSON object"):
        rebuild_spec(ENTRY, "ci-dummy_dummy", "/results", ["BASE_DOCKER=busybox"])
