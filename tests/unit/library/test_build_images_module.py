"""The build_images module: builds or reuses model images on a real (private) Docker daemon, writes the manifest."""

import base64
import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_manifest,
    read_build_failures,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL
from tests.support.buildkit import buildkit_docker_cli
from tests.support.lab.model_zoo import make_model_zoo

ROOT = Path(__file__).resolve().parents[3]
AMD = {"gpu_vendor": "AMD", "guest_os": "UBUNTU"}


def _load_module():
    spec = importlib.util.spec_from_file_location("build_images", ROOT / "library" / "build_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_IMAGES = _load_module()


@pytest.fixture
def docker_host(private_dockerd, monkeypatch):
    """The module's docker CLI talks to the private daemon."""
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    return private_dockerd


@pytest.fixture
def zoo(tmp_path):
    return make_model_zoo(tmp_path / "zoo")


@pytest.fixture
def run_module(capsys, docker_host):
    """Run build_images in this process as Ansible would; returns its result dict."""

    def run(check_mode=False, **args):
        with patch_module_args(dict(args, _ansible_check_mode=check_mode)):
            with pytest.raises(SystemExit):
                BUILD_IMAGES.main()
        return json.loads(capsys.readouterr().out)

    return run


def module_args(zoo, tags, context=AMD, **extra):
    return dict(
        models_file=str(zoo / "models.json"),
        tags=tags,
        context=context,
        manifest_path=str(zoo / "out" / "build_manifest.json"),
        **extra,
    )


def image_file(dockerd, image, path):
    """The content of a file inside an image."""
    return dockerd.docker("run", "--rm", "--network=none", image, "cat", path).stdout


# --- building and the manifest -----------------------------------------------------------------------------------


@pytest.fixture
def first_build(zoo, run_module):
    return zoo, run_module(**module_args(zoo, ["dummy"]))


def test_builds_the_selected_image_and_reports_it(first_build, docker_host):
    _, result = first_build
    image_id = docker_host.docker("image", "inspect", "--format", "{{.Id}}", "ci-dummy_dummy.ubuntu.amd").stdout.strip()
    assert result["changed"] is True
    assert (result["image_name"], result["image_id"]) == ("ci-dummy_dummy.ubuntu.amd", image_id)
    assert result["images"][0]["action"] == "built"


def test_writes_the_manifest_in_mads_shape(first_build):
    zoo, result = first_build
    manifest = load_manifest(result["manifest_path"])
    entry = manifest["built_images"]["ci-dummy_dummy.ubuntu.amd"]
    assert entry["docker_image"] == "ci-dummy_dummy.ubuntu.amd" and entry["image_id"] == result["image_id"]
    assert entry["dockerfile"] == str(zoo / "docker" / "dummy.ubuntu.amd.Dockerfile")
    assert manifest["built_models"]["ci-dummy_dummy.ubuntu.amd"]["name"] == "dummy"
    assert manifest["context"]["gpu_vendor"] == "AMD" and manifest["deployment_config"] == {}


def test_build_log_goes_to_the_manifests_directory_by_default(first_build):
    zoo, result = first_build
    assert result["images"][0]["log_file"] == str(zoo / "out" / "dummy_dummy.ubuntu.amd.build.live.log")
    assert os.path.getsize(result["images"][0]["log_file"]) > 0


def test_second_run_reuses_the_image_and_changes_nothing(first_build, run_module):
    zoo, first = first_build
    manifest_before = Path(first["manifest_path"]).stat().st_mtime_ns
    again = run_module(**module_args(zoo, ["dummy"]))
    assert again["changed"] is False and again["manifest_written"] is False
    assert (again["images"][0]["action"], again["image_id"]) == ("reused", first["image_id"])
    assert Path(first["manifest_path"]).stat().st_mtime_ns == manifest_before


def test_force_rebuild_builds_again(first_build, run_module):
    zoo, _ = first_build
    result = run_module(**module_args(zoo, ["dummy"], force_rebuild=True))
    assert result["changed"] is True and result["images"][0]["action"] == "built"
    assert result["images"][0]["reason"] == "force_rebuild is set"


def test_check_mode_reports_what_would_be_built_and_writes_nothing(zoo, run_module, docker_host):
    result = run_module(check_mode=True, **module_args(zoo, ["dummy_multi"]))
    assert result["changed"] is True and result["images"][0]["action"] == "would_build"
    assert not (zoo / "out" / "build_manifest.json").exists()
    fingerprint = result["images"][0]["build_fingerprint"]
    assert docker_host.docker("images", "-q", "--filter", f"label={FINGERPRINT_LABEL}={fingerprint}").stdout == ""


def test_several_fitting_dockerfiles_build_several_images_and_no_single_id(zoo, run_module):
    result = run_module(check_mode=True, **module_args(zoo, ["dummy"], context={"guest_os": "UBUNTU"}))
    assert [image["image_name"] for image in result["images"]] == [
        "ci-dummy_dummy.ubuntu.amd",
        "ci-dummy_dummy.ubuntu.nvidia",
    ]
    assert result["image_id"] is None and result["image_name"] is None


# --- literal build args and secrets ------------------------------------------------------------------------------


@pytest.fixture
def hostile_build(zoo, run_module):
    marker = Path(f"/tmp/slurm-multi-pwned-{uuid.uuid4().hex}")
    note = f"x'; touch {marker}; '$(touch {marker})`touch {marker}`"
    result = run_module(**module_args(zoo, ["build_args"], context=dict(AMD, docker_build_arg={"BUILD_NOTE": note})))
    return marker, note, result


def test_injection_build_arg_runs_nothing_on_the_host(hostile_build):
    marker, _, result = hostile_build
    assert result["images"][0]["action"] == "built" and not marker.exists()


def test_injection_build_arg_reaches_the_image_literally(hostile_build, docker_host):
    _, note, result = hostile_build
    assert image_file(docker_host, result["image_name"], "/build_note.txt") == note


BUILD_SECRET = "tok-secret-123-9d0e7b"
BUILD_SECRET_BASE64 = base64.b64encode(BUILD_SECRET.encode()).decode()


@pytest.fixture(params=["passing"])
def secret_mount_build(request, zoo, run_module, tmp_path):
    """build_args' Dockerfile reading MAD_SECRETS_BUILD_TOKEN from a BuildKit secret mount, the job's secrets file."""
    (zoo / "docker" / "dummy_build_args.ubuntu.amd.Dockerfile").write_text(
        "# CONTEXT {'gpu_vendor': 'AMD'}\nFROM scratch\nCOPY busybox /bin/busybox\n"
        'RUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
        # The step prints the secret, as `set -x` or `curl -v` would, and its base64 form; the nonce: BuildKit
        # reuses a cached step whose secret changed (another test's build of this step). Its trace goes to stdout:
        # BuildKit reads a step's stdout and stderr apart, and the shell writes a trace line in pieces, so on a busy
        # machine the secret `cat` printed could land inside "+ cat /run/secrets/..." (a CI run lost that line so).
        "RUN --mount=type=secret,id=MAD_SECRETS_BUILD_TOKEN,required=true exec 2>&1 && set -x "
        "&& cat /run/secrets/MAD_SECRETS_BUILD_TOKEN && base64 /run/secrets/MAD_SECRETS_BUILD_TOKEN "
        "&& sha256sum /run/secrets/MAD_SECRETS_BUILD_TOKEN | cut -d' ' -f1 > /build_token.sha256 "
        f"&& echo {uuid.uuid4().hex}" + (" && exit 3" if request.param == "failing" else "") + "\n"
    )
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"MAD_SECRETS_BUILD_TOKEN={BUILD_SECRET}\n")
    secrets.chmod(0o600)
    return run_module(
        **module_args(zoo, ["build_args"], secrets_file=str(secrets), buildkit_docker_cli=buildkit_docker_cli())
    )


def test_secret_mount_reaches_the_build_from_the_secrets_file(secret_mount_build, docker_host):
    assert (
        image_file(docker_host, secret_mount_build["image_name"], "/build_token.sha256").strip()
        == hashlib.sha256(BUILD_SECRET.encode()).hexdigest()
    )


def test_secret_mount_value_is_not_in_the_manifest_the_result_or_the_build_log(secret_mount_build):
    log = Path(secret_mount_build["images"][0]["log_file"])
    assert "+ cat /run/secrets/MAD_SECRETS_BUILD_TOKEN" in log.read_text()  # the step did print it,
    assert log.read_text().count("********") >= 2  # and its value and base64 form were masked
    for trace in (
        Path(secret_mount_build["manifest_path"]).read_text(),
        json.dumps(secret_mount_build),
        log.read_text(),
    ):
        assert BUILD_SECRET not in trace and BUILD_SECRET_BASE64 not in trace
    assert stat.S_IMODE(log.stat().st_mode) == 0o640


@pytest.mark.parametrize("secret_mount_build", ["failing"], indirect=True)
def test_a_failed_build_that_printed_its_secret_names_it_in_neither_its_message_nor_its_log(secret_mount_build):
    assert secret_mount_build["failed"] is True and "exit" in secret_mount_build["msg"]
    assert "+ cat /run/secrets/MAD_SECRETS_BUILD_TOKEN" in secret_mount_build["msg"]  # the log's last lines
    log_files = list(Path(secret_mount_build["msg"].split("full log: ")[1].split(";")[0]).parent.glob("*.log"))
    for trace in (json.dumps(secret_mount_build), *(path.read_text() for path in log_files)):
        assert BUILD_SECRET not in trace and BUILD_SECRET_BASE64 not in trace


def test_secret_build_arg_fails_saying_how_to_mount_it_and_builds_nothing(zoo, run_module, monkeypatch):
    monkeypatch.setenv("MAD_SECRETS_BUILD_TOKEN", BUILD_SECRET)
    context = dict(AMD, docker_build_arg={"MAD_SECRETS_BUILD_TOKEN": "${MAD_SECRETS_BUILD_TOKEN}"})
    result = run_module(**module_args(zoo, ["build_args"], context=context))
    assert result["failed"] is True
    assert "RUN --mount=type=secret,id=MAD_SECRETS_BUILD_TOKEN" in result["msg"]
    assert not (zoo / "out").exists()


# --- refusals before anything is built ---------------------------------------------------------------------------


def test_unknown_tag_fails_listing_the_models(zoo, run_module):
    result = run_module(**module_args(zoo, ["dumy"]))
    assert result["failed"] is True
    assert result["msg"].startswith("tag 'dumy' matches no model. Model names: dummy, dummy_build_args, dummy_multi.")


def test_malformed_registry_fails_before_building(zoo, run_module):
    result = run_module(**module_args(zoo, ["dummy_multi"], registry="@bad/foo"))
    assert result["failed"] is True and "invalid registry '@bad/foo'" in result["msg"]
    assert not (zoo / "out").exists()


def test_no_fitting_dockerfile_fails_naming_the_candidates(zoo, run_module):
    result = run_module(**module_args(zoo, ["dummy"], context={"gpu_vendor": "INTEL"}))
    assert result["failed"] is True and "dummy.ubuntu.nvidia.Dockerfile {'gpu_vendor': 'NVIDIA'" in result["msg"]


def test_malformed_existing_manifest_fails_and_is_kept(zoo, run_module):
    manifest = zoo / "out" / "build_manifest.json"
    manifest.parent.mkdir()
    manifest.write_text("{not json")
    result = run_module(**module_args(zoo, ["dummy_multi"]))
    assert result["failed"] is True and "is not valid JSON" in result["msg"]
    assert manifest.read_text() == "{not json"


@pytest.fixture
def zoo_with_a_broken_image(zoo):
    """The zoo plus dummy_broken, whose Dockerfile copies a file its context lacks: its build fails."""
    (zoo / "docker" / "dummy_broken.ubuntu.amd.Dockerfile").write_text("FROM scratch\nCOPY no-such-file /x\n")
    cards = json.loads((zoo / "models.json").read_text())
    cards.append(dict(cards[0], name="dummy_broken", tags=["broken"], dockerfile="docker/dummy_broken"))
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo


def test_a_sweeps_build_keeps_going_past_an_image_that_fails(zoo_with_a_broken_image, run_module):
    zoo = zoo_with_a_broken_image
    result = run_module(**module_args(zoo, ["dummy_multi", "dummy_broken"], keep_going=True))
    assert "failed" not in result, result.get("msg")
    assert [failure["model"] for failure in result["failed_builds"]] == ["dummy_broken"]
    assert "docker build of ci-dummy_broken_dummy_broken.ubuntu.amd" in result["failed_builds"][0]["error"]
    manifest = load_manifest(result["manifest_path"])
    assert [card["name"] for card in manifest["built_models"].values()] == ["dummy_multi"]
    assert read_build_failures(result["manifest_path"]) == result["failed_builds"]


def test_a_sweeps_build_fails_when_its_first_image_fails_but_builds_the_others(zoo_with_a_broken_image, run_module):
    zoo = zoo_with_a_broken_image
    result = run_module(**module_args(zoo, ["dummy_broken", "dummy_multi"], keep_going=True))
    assert result["failed"] is True and "docker build of ci-dummy_broken" in result["msg"]
    manifest = load_manifest(zoo / "out" / "build_manifest.json")
    assert [card["name"] for card in manifest["built_models"].values()] == ["dummy_multi"]


def test_without_keep_going_a_failed_build_fails_the_whole_build(zoo_with_a_broken_image, run_module):
    result = run_module(**module_args(zoo_with_a_broken_image, ["dummy_multi", "dummy_broken"]))
    assert result["failed"] is True and "docker build of ci-dummy_broken" in result["msg"]
    assert not (zoo_with_a_broken_image / "out" / "build_manifest.json").exists()


# --- through Ansible itself --------------------------------------------------------------------------------------


def test_runs_through_ansible_with_the_projects_module_utils(zoo, docker_host):
    args = json.dumps(module_args(zoo, ["dummy"]))
    env = dict(docker_host.env, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_INVENTORY_ENABLED="host_list")
    completed = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-m",
            "build_images",
            "-a",
            args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert load_manifest(zoo / "out" / "build_manifest.json")["built_images"]["ci-dummy_dummy.ubuntu.amd"]["image_id"]
