"""Prebuilt images (`--use-image`): the reference checked, the job's manifest for it, the build module's refusals
on a real (private) Docker daemon, and the job spec's."""

import json
import socket

import pytest

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_manifest,
    validate_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    ImageNameError,
    is_registry_reference,
    prebuilt_image_reference,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.prebuilt import (
    PrebuiltImageError,
    local_image_id,
    prebuilt_manifest,
)
from plugins.filter.manifest_image import image_in_registry, manifest_image_reference
from slurm_multi.errors import SlurmMultiError
from tests.unit.library.test_build_images_module import docker_host, module_args, run_module, zoo  # noqa: F401 (fixtures)

CARD = {"name": "dummy", "dockerfile": "docker/dummy", "scripts": "scripts/dummy/run.sh", "args": "--x 1"}
DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    "reference",
    ["my-image", "my-image:v1", "team/bench:2026.11", "127.0.0.1:17500/ns/img:v1", f"ghcr.io/org/repo@{DIGEST}"],
)
def test_a_docker_reference_is_taken_as_given(reference):
    assert prebuilt_image_reference(f" {reference} ") == reference


@pytest.mark.parametrize(
    "reference, problem",
    [
        ("", "it is empty"),
        ("my image", "whitespace"),
        ("My-Image:v1", "uppercase is not allowed"),
        ("https://ghcr.io/org/repo", "no URL scheme"),
        ("img:", "tag '' is not valid"),
        ("img@sha256:abc", "is not a digest"),
        (DIGEST, "an image ID names no image another node can get"),
        ("bad_host_:5000/x", "is not a valid registry host"),
        ("team/b@d/x", "is not a digest"),
        ("team/-x:v1", "lowercase letters, digits"),
    ],
)
def test_what_is_not_a_docker_reference_is_refused_saying_why(reference, problem):
    with pytest.raises(ImageNameError) as error:
        prebuilt_image_reference(reference)
    assert problem in str(error.value) and f"--use-image {reference!r}" in str(error.value)


@pytest.mark.parametrize(
    "reference, in_registry",
    [
        ("my-image:v1", False),
        ("rocm/pytorch:latest", False),
        ("localhost/x", True),
        ("127.0.0.1:17500/ns/img:v1", True),
        (f"img@{DIGEST}", True),
    ],
)
def test_a_registry_image_names_a_host_or_a_digest(reference, in_registry):
    assert is_registry_reference(reference) is in_registry
    assert image_in_registry(reference) is in_registry


def test_no_prebuilt_image_is_not_a_registry_image():
    assert image_in_registry("") is False


def test_a_registry_image_is_recorded_as_the_manifests_registry_image_for_every_node_to_pull():
    manifest = validate_manifest(prebuilt_manifest(CARD, "127.0.0.1:17500/ns/img:v1", {"gpu_vendor": "AMD"}))
    entry = manifest["built_images"]["127.0.0.1:17500/ns/img:v1"]
    assert (entry["registry_image"], entry["prebuilt"], entry["image_id"]) == ("127.0.0.1:17500/ns/img:v1", True, None)
    assert "registry_image_by_digest" not in entry
    assert manifest["built_models"]["127.0.0.1:17500/ns/img:v1"] == CARD
    assert manifest_image_reference(manifest, True) == "127.0.0.1:17500/ns/img:v1"


def test_a_registry_image_by_digest_is_what_every_node_runs():
    manifest = prebuilt_manifest(CARD, f"ghcr.io/org/repo@{DIGEST}", {})
    assert manifest_image_reference(manifest, True) == f"ghcr.io/org/repo@{DIGEST}"


def test_a_local_image_no_daemon_holds_is_an_error_naming_the_image_and_the_node(private_dockerd):
    with pytest.raises(PrebuiltImageError) as error:
        local_image_id("slurm-multi-test/absent:v1", node="node1", host=private_dockerd.host)
    assert "node1 (rank 0) has no image slurm-multi-test/absent:v1" in str(error.value)
    assert "docker load" in str(error.value)


# --- the build module with prebuilt_image --------------------------------------------------------------------------


def test_a_local_prebuilt_image_is_recorded_with_its_id_and_nothing_is_built(zoo, run_module, busybox_image):  # noqa: F811
    tag, image_id = busybox_image
    result = run_module(**module_args(zoo, ["dummy"], prebuilt_image=tag))
    assert result.get("failed") is not True, result
    assert (result["image_name"], result["image_id"], result["images"][0]["action"]) == (tag, image_id, "prebuilt")
    manifest = load_manifest(zoo / "out" / "build_manifest.json")
    assert manifest["built_images"][tag]["image_id"] == image_id
    assert manifest["built_models"][tag]["name"] == "dummy"
    assert manifest_image_reference(manifest, False) == tag
    assert not list((zoo / "out").glob("*.build.live.log"))


def test_a_local_prebuilt_image_rank0_lacks_fails_naming_the_image_and_the_node(zoo, run_module):  # noqa: F811
    result = run_module(**module_args(zoo, ["dummy"], prebuilt_image="slurm-multi-test/absent:v1"))
    assert result["failed"] is True
    assert f"{socket.gethostname()} (rank 0) has no image slurm-multi-test/absent:v1" in result["msg"]
    assert not (zoo / "out").exists()


def test_a_prebuilt_image_with_tags_selecting_two_cards_is_refused(zoo, run_module):  # noqa: F811
    result = run_module(**module_args(zoo, ["dummy", "dummy_multi"], prebuilt_image="img:v1"))
    assert result["failed"] is True and "runs one model card, but tags" in result["msg"], result["msg"]


def test_a_prebuilt_image_that_is_no_reference_is_refused_by_the_module(zoo, run_module):  # noqa: F811
    result = run_module(**module_args(zoo, ["dummy"], prebuilt_image="Not A Reference"))
    assert result["failed"] is True and "is not a Docker image reference" in result["msg"]


# --- the job spec ------------------------------------------------------------------------------------------------


def test_the_job_runs_the_prebuilt_image_given(tmp_path):
    spec = slurm_multi.job_spec("dummy", results_dir=tmp_path, use_image="my-image:v1")
    assert spec.use_image == "my-image:v1"
    assert spec.job_vars()["use_image"] == "my-image:v1"


def test_no_prebuilt_image_sets_no_job_var(tmp_path):
    assert "use_image" not in slurm_multi.job_spec("dummy", results_dir=tmp_path).job_vars()


def test_a_prebuilt_image_that_is_no_reference_is_refused_before_submitting(tmp_path):
    with pytest.raises(SlurmMultiError, match="--use-image 'Bad Image' is not a Docker image reference"):
        slurm_multi.job_spec("dummy", results_dir=tmp_path, use_image="Bad Image")


def test_a_prebuilt_image_and_a_manifest_are_refused_together(tmp_path):
    manifest = tmp_path / "build_manifest.json"
    manifest.write_text(json.dumps(prebuilt_manifest(CARD, "127.0.0.1:5000/x:v1", {})))
    with pytest.raises(SlurmMultiError, match="both name the image to run: give one of them"):
        slurm_multi.job_spec("dummy", results_dir=tmp_path, use_image="img:v1", manifest_path=manifest)


def test_a_prebuilt_image_in_registry_mode_is_refused(tmp_path):
    with pytest.raises(SlurmMultiError, match="drop --registry 127.0.0.1:5000/ns"):
        slurm_multi.job_spec("dummy", results_dir=tmp_path, use_image="img:v1", registry="127.0.0.1:5000/ns")


def test_a_prebuilt_registry_image_takes_the_credentials_of_its_registry(tmp_path):
    credentials = tmp_path / "credential.json"
    credentials.write_text(json.dumps({"127.0.0.1:5000": {"username": "u", "password": "p4ssw0rd-long"}}))
    credentials.chmod(0o600)
    spec = slurm_multi.job_spec(
        "dummy", results_dir=tmp_path, use_image="127.0.0.1:5000/ns/img:v1", credentials_file=credentials
    )
    assert spec.credentials_file == credentials


def test_the_cli_hands_use_image_to_the_job(capsys):
    from slurm_multi import cli

    assert cli.main(["submit", "--nodes", "2", "--tags", "dummy", "--use-image", "my-image:v1", "--dry-run"]) == 0
    assert '"use_image": "my-image:v1"' in capsys.readouterr().out


def test_the_job_copies_the_credentials_entry_of_the_prebuilt_images_registry(tmp_path):
    from slurm_multi.submission.credentials import write_credentials_copy

    credentials = tmp_path / "credential.json"
    credentials.write_text(json.dumps({"127.0.0.1:5000": {"username": "u", "password": "p4ssw0rd-long"}}))
    credentials.chmod(0o600)
    spec = slurm_multi.job_spec(
        "dummy", results_dir=tmp_path, use_image="127.0.0.1:5000/ns/img:v1", credentials_file=credentials
    )
    private = tmp_path / "private"
    private.mkdir()
    copy = write_credentials_copy(private, spec.credentials_file, spec.login_registry)
    assert json.loads(copy.read_text())["127.0.0.1:5000"]["username"] == "u"
