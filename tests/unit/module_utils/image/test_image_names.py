"""Local image names, the build fingerprint and --registry normalization."""

import re

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    MAX_LOCAL_NAME_LENGTH,
    ImageNameError,
    build_fingerprint,
    digest_reference,
    docker_safe_name,
    is_digest_reference,
    local_image_name,
    normalize_registry,
    registry_image_name,
    repository_of,
)

# Docker's grammar for one repository path component, and for a tag.
DOCKER_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
DOCKER_TAG = re.compile(r"^[\w][\w.-]{0,127}$")


# --- local image names ------------------------------------------------------------------------------------------


def test_local_name_is_mads_ci_model_dockerfile_stem():
    assert local_image_name("dummy", "/zoo/docker/dummy.ubuntu.amd.Dockerfile") == "ci-dummy_dummy.ubuntu.amd"


def test_local_name_of_a_nested_model_replaces_the_slash():
    assert (
        local_image_name("MAD-private/pyt_x", "docker/pyt_x.ubuntu.amd.Dockerfile")
        == "ci-mad-private_pyt_x_pyt_x.ubuntu.amd"
    )


def test_local_name_of_a_plain_dockerfile_is_lowercased():
    assert (
        local_image_name("pyt_kvcache_transfer_bench", "scripts/kv/Dockerfile")
        == "ci-pyt_kvcache_transfer_bench_dockerfile"
    )


@pytest.mark.parametrize("raw", ["Model With Spaces", "a@b#c", "x._y", "a___b", "__lead", "trail--", "ümlaut.ß"])
def test_safe_name_is_a_valid_docker_name(raw):
    assert DOCKER_COMPONENT.match(docker_safe_name(raw))


def test_safe_name_keeps_valid_separators():
    assert docker_safe_name("ci-a__b.c--d_e") == "ci-a__b.c--d_e"


def test_long_name_is_bounded_and_stays_a_valid_tag():
    name = local_image_name("m" * 300, "docker/x.Dockerfile")
    assert len(name) <= MAX_LOCAL_NAME_LENGTH and DOCKER_TAG.match(name) and DOCKER_COMPONENT.match(name)


def test_two_long_names_differing_at_the_end_stay_distinct():
    assert docker_safe_name("a" * 200 + "1") != docker_safe_name("a" * 200 + "2")


def test_name_without_letters_or_digits_is_refused():
    with pytest.raises(ImageNameError, match="no letters or digits"):
        docker_safe_name("@@@")


# --- build fingerprint ------------------------------------------------------------------------------------------


@pytest.fixture
def dockerfile(tmp_path):
    path = tmp_path / "x.Dockerfile"
    path.write_text("FROM scratch\n")
    return path


def test_fingerprint_is_a_sha256_hex(dockerfile):
    assert re.fullmatch(r"[0-9a-f]{64}", build_fingerprint(dockerfile, {}))


def test_fingerprint_is_stable(dockerfile):
    assert build_fingerprint(dockerfile, {"A": "1", "B": "2"}) == build_fingerprint(dockerfile, {"B": "2", "A": "1"})


def test_fingerprint_changes_with_the_dockerfile(dockerfile):
    before = build_fingerprint(dockerfile, {})
    dockerfile.write_text("FROM scratch\nRUN true\n")
    assert build_fingerprint(dockerfile, {}) != before


def test_fingerprint_changes_with_a_build_arg(dockerfile):
    assert build_fingerprint(dockerfile, {"A": "1"}) != build_fingerprint(dockerfile, {"A": "2"})


def test_fingerprint_ignores_secret_build_arg_values(dockerfile):
    assert build_fingerprint(dockerfile, {"MAD_SECRETS_HF": "old"}) == build_fingerprint(
        dockerfile, {"MAD_SECRETS_HF": "new"}
    )


def test_fingerprint_changes_with_build_context_content(dockerfile, tmp_path):
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "run.sh").write_text("echo 1\n")
    before = build_fingerprint(dockerfile, {}, context)
    (context / "run.sh").write_text("echo 2\n")
    assert build_fingerprint(dockerfile, {}, context) != before


def test_fingerprint_changes_when_a_context_file_is_added(dockerfile, tmp_path):
    context = tmp_path / "ctx"
    context.mkdir()
    before = build_fingerprint(dockerfile, {}, context)
    (context / "new.txt").write_text("")
    assert build_fingerprint(dockerfile, {}, context) != before


def test_fingerprint_changes_with_a_base_images_id_under_the_same_name(dockerfile):
    old = build_fingerprint(dockerfile, {}, None, {"lab/base:latest": "sha256:" + "1" * 64})
    assert build_fingerprint(dockerfile, {}, None, {"lab/base:latest": "sha256:" + "2" * 64}) != old


def test_fingerprint_counts_every_base_image_of_a_multi_stage_build(dockerfile):
    bases = {"golang:1.22": "sha256:" + "a" * 64, "lab/base:latest": "sha256:" + "1" * 64}
    before = build_fingerprint(dockerfile, {}, None, bases)
    assert build_fingerprint(dockerfile, {}, None, dict(bases, **{"golang:1.22": "sha256:" + "b" * 64})) != before


# --- registry normalization -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, normalized",
    [
        ("rocm/pytorch-private", "docker.io/rocm/pytorch-private"),
        ("rocmshared", "docker.io/rocmshared"),
        ("docker.io/rocm/pytorch-private", "docker.io/rocm/pytorch-private"),
        ("index.docker.io/rocm/pytorch", "docker.io/rocm/pytorch"),
        ("ghcr.io/myorg/myrepo", "ghcr.io/myorg/myrepo"),
        ("quay.io/org/repo", "quay.io/org/repo"),
        ("localhost:5000/myrepo", "localhost:5000/myrepo"),
        ("localhost:5000", "localhost:5000"),
        ("192.168.1.10:5000/myrepo", "192.168.1.10:5000/myrepo"),
        ("registry.example.com:5000/myrepo", "registry.example.com:5000/myrepo"),
        ("  rocm/pytorch-private  ", "docker.io/rocm/pytorch-private"),
        ("ghcr.io/myorg/myrepo/", "ghcr.io/myorg/myrepo"),
    ],
)
def test_registry_shapes_are_normalized(given, normalized):
    assert normalize_registry(given) == normalized


@pytest.mark.parametrize(
    "given, problem",
    [
        ("@bad/foo", "'@' is not allowed"),
        ("", "it is empty"),
        ("   ", "it is empty"),
        (None, "it is empty"),
        ("rocm/ pytorch", "whitespace"),
        ("rocm/PyTorch", "must be lowercase"),
        ("http://registry.example.com/repo", "URL scheme"),
        ("https://ghcr.io/org/repo", "URL scheme"),
        ("rocm/pytorch:latest", "a tag is not allowed"),
        ("docker.io", "Docker Hub needs a namespace"),
        ("rocm//pytorch", "not a valid repository path component"),
        ("bad_host_.io/repo", "not a valid registry host"),
        ("rocm/-pytorch", "not a valid repository path component"),
    ],
)
def test_malformed_registry_is_refused_with_the_problem(given, problem):
    with pytest.raises(ImageNameError, match=re.escape(problem)):
        normalize_registry(given)


def test_registry_error_shows_valid_examples():
    with pytest.raises(ImageNameError, match=r"Valid examples: rocm/pytorch-private .*localhost:5000/myrepo"):
        normalize_registry("@bad/foo")


@pytest.mark.parametrize(
    "registry, image",
    [
        ("rocm/pytorch-private", "docker.io/rocm/pytorch-private:ci-dummy_dummy.ubuntu.amd"),
        ("ghcr.io/org/repo", "ghcr.io/org/repo:ci-dummy_dummy.ubuntu.amd"),
        ("localhost:5000/myrepo", "localhost:5000/myrepo:ci-dummy_dummy.ubuntu.amd"),
        ("rocmshared", "docker.io/rocmshared/ci-dummy_dummy.ubuntu.amd"),
        ("localhost:5000", "localhost:5000/ci-dummy_dummy.ubuntu.amd"),
    ],
)
def test_registry_image_name_per_registry_shape(registry, image):
    assert registry_image_name(normalize_registry(registry), "ci-dummy_dummy.ubuntu.amd") == image


# --- references by digest ----------------------------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "reference, repository",
    [
        ("127.0.0.1:17500/ns:ci-dummy_dummy.ubuntu.amd", "127.0.0.1:17500/ns"),
        ("localhost:5000/repo", "localhost:5000/repo"),
        ("docker.io/rocmshared/ci-m_m.ubuntu.amd", "docker.io/rocmshared/ci-m_m.ubuntu.amd"),
        (f"ghcr.io/org/repo@{DIGEST}", "ghcr.io/org/repo"),
        (f"registry.example.com:5000/team/repo:tag@{DIGEST}", "registry.example.com:5000/team/repo"),
    ],
)
def test_repository_of_drops_the_tag_and_digest_but_keeps_the_port(reference, repository):
    assert repository_of(reference) == repository


def test_digest_reference_pins_the_pushed_tag_to_its_content():
    assert digest_reference("127.0.0.1:17500/ns:ci-dummy_dummy.ubuntu.amd", DIGEST) == f"127.0.0.1:17500/ns@{DIGEST}"


@pytest.mark.parametrize("digest", ["", "sha256:abc", "md5:" + "ab" * 16, "ab" * 32, "sha256:" + "AB" * 32])
def test_digest_reference_refuses_what_is_not_a_sha256_digest(digest):
    with pytest.raises(ImageNameError, match="is not an image digest"):
        digest_reference("localhost:5000/repo:tag", digest)


def test_only_a_sha256_digest_makes_a_reference_by_digest():
    assert is_digest_reference(f"localhost:5000/repo@{DIGEST}")
    assert not is_digest_reference("localhost:5000/repo:tag")
    assert not is_digest_reference("localhost:5000/repo@sha256:short")
