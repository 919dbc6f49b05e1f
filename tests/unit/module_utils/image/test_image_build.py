"""Planning, building, reusing and pushing model images, against a real (private) Docker daemon."""

import hashlib
import os
import socket
import stat
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    ImageBuildError,
    build_log_name,
    docker_build_argv,
    ensure_image,
    inspect_image,
    manifest_image_entry,
    plan_image_builds,
    push_image,
    record_builds,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_model_cards,
    select_model_cards,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_secrets import build_secret_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_selection import (
    DockerfileSelectionError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL
from tests.support.buildkit import buildkit_docker_cli, docker_cli_without_buildkit
from tests.support.dockerd import build_busybox_image
from tests.support.lab.model_zoo import make_model_zoo

AMD = {"gpu_vendor": "AMD", "guest_os": "UBUNTU"}


@pytest.fixture
def zoo(tmp_path):
    return make_model_zoo(tmp_path / "zoo")


def plans_for(zoo, tags, context=AMD, secrets_file=None):
    cards = select_model_cards(load_model_cards(zoo / "models.json"), tags)
    return plan_image_builds(zoo, cards, context, zoo / "logs", secrets_file=secrets_file)


BUILD_SECRET = "tok-build-secret-4f1c9a"
SECRET_MOUNT_DOCKERFILE = (
    "# CONTEXT {'gpu_vendor': 'AMD'}\nFROM scratch\nCOPY busybox /bin/busybox\n"
    'RUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
    "RUN --mount=type=secret,id=MAD_SECRETS_BUILD_TOKEN,required=true "
    "sha256sum /run/secrets/MAD_SECRETS_BUILD_TOKEN | cut -d' ' -f1 > /build_token.sha256 && echo NONCE\n"
)


def secret_mount_zoo(zoo):
    """The zoo with its build_args Dockerfile reading MAD_SECRETS_BUILD_TOKEN from a secret mount (its own image
    name: other tests of this module share the daemon's `dummy` images). The nonce gives the step its own cache
    key: BuildKit reuses a cached step whose secret changed, so a step cached by another test saw another secret."""
    (zoo / "docker" / "dummy_build_args.ubuntu.amd.Dockerfile").write_text(
        SECRET_MOUNT_DOCKERFILE.replace("NONCE", uuid.uuid4().hex)
    )
    return zoo


def secrets_file(tmp_path, text=f"MAD_SECRETS_BUILD_TOKEN={BUILD_SECRET}\n"):
    path = tmp_path / "secrets.env"
    path.write_text(text)
    path.chmod(0o600)
    return path


# --- planning (no daemon needed) ---------------------------------------------------------------------------------


def test_one_plan_per_card_and_fitting_dockerfile(zoo):
    plans = plans_for(zoo, ["dummies"], context={"guest_os": "UBUNTU"})
    assert [plan.image_name for plan in plans] == [
        "ci-dummy_dummy.ubuntu.amd",
        "ci-dummy_dummy.ubuntu.nvidia",
        "ci-dummy_multi_dummy.ubuntu.amd",
        "ci-dummy_multi_dummy.ubuntu.nvidia",
    ]


def test_plan_uses_mads_log_file_name(zoo):
    [plan] = plans_for(zoo, ["dummy"])
    assert plan.log_file == str(zoo / "logs" / "dummy_dummy.ubuntu.amd.build.live.log")


def test_log_name_of_a_nested_model_has_no_slash():
    assert build_log_name("team/m", "/z/docker/m.amd.Dockerfile") == "team_m_m.amd.build.live.log"


def test_plan_fails_before_building_when_a_card_has_no_fitting_dockerfile(zoo):
    with pytest.raises(DockerfileSelectionError, match="no Dockerfile fits"):
        plans_for(zoo, ["dummy"], context={"gpu_vendor": "INTEL"})


def test_plan_records_the_dockerfiles_gpu_vendor(zoo):
    [plan] = plans_for(zoo, ["dummy"], context={"gpu_vendor": "NVIDIA"})
    assert plan.gpu_vendor == "NVIDIA"


def test_build_argv_has_each_component_as_one_element(zoo):
    context = dict(AMD, docker_build_arg={"BUILD_NOTE": "x'; touch /tmp/pwned; '"})
    [plan] = plans_for(zoo, ["build_args"], context=context)
    argv = docker_build_argv(plan)
    assert argv[:4] == ["docker", "build", "--network=host", "-t"]
    assert ["--build-arg", "BUILD_NOTE=x'; touch /tmp/pwned; '"] == argv[argv.index("--build-arg") :][:2]
    assert f"{FINGERPRINT_LABEL}={plan.fingerprint}" in argv and argv[-1] == str(zoo / "docker")


def test_secret_build_arg_is_refused_naming_the_secret_mount(zoo):
    context = dict(AMD, docker_build_arg={"MAD_SECRETS_BUILD_TOKEN": "${MAD_SECRETS_BUILD_TOKEN}"})
    with pytest.raises(ImageBuildError) as error:
        plans_for(zoo, ["build_args"], context=context)
    message = str(error.value)
    assert message.startswith("docker_build_arg MAD_SECRETS_BUILD_TOKEN is a secret: Docker records build args")
    assert "RUN --mount=type=secret,id=MAD_SECRETS_BUILD_TOKEN" in message
    assert "/run/secrets/MAD_SECRETS_BUILD_TOKEN" in message and "secrets file" in message


def test_build_arg_whose_value_refers_to_a_secret_is_refused(zoo):
    context = dict(AMD, docker_build_arg={"HF_TOKEN": "${MAD_SECRETS_HF}"})
    with pytest.raises(
        ImageBuildError,
        match=r"^docker_build_arg HF_TOKEN refers to MAD_SECRETS_HF, a secret: .*"
        r"id=MAD_SECRETS_HF",
    ):
        plans_for(zoo, ["build_args"], context=context)


def test_dockerfile_without_mounts_is_built_as_before(zoo):
    [plan] = plans_for(zoo, ["dummy"])
    assert (plan.buildkit, plan.build_secrets) == (False, {})
    assert "--progress=plain" not in docker_build_argv(plan) and "--secret" not in docker_build_argv(plan)


def test_mounted_secret_takes_its_value_from_the_secrets_file_and_is_never_in_argv(zoo, tmp_path):
    [plan] = plans_for(secret_mount_zoo(zoo), ["build_args"], secrets_file=secrets_file(tmp_path))
    assert plan.buildkit is True and plan.build_secrets == {"MAD_SECRETS_BUILD_TOKEN": BUILD_SECRET}
    argv = docker_build_argv(plan, secret_files={"MAD_SECRETS_BUILD_TOKEN": "/dev/shm/x/secret-0"})
    assert argv[argv.index("--secret") + 1] == "id=MAD_SECRETS_BUILD_TOKEN,src=/dev/shm/x/secret-0"
    assert not any(BUILD_SECRET in part for part in argv)


def test_mounted_secret_missing_from_the_secrets_file_is_refused_before_building(zoo, tmp_path):
    other = secrets_file(tmp_path, "MAD_SECRETS_OTHER=some-other-value\n")
    with pytest.raises(
        ImageBuildError,
        match=r"mounts the build secret MAD_SECRETS_BUILD_TOKEN .* secrets file "
        rf"{other} has no MAD_SECRETS_BUILD_TOKEN: export it",
    ):
        plans_for(secret_mount_zoo(zoo), ["build_args"], secrets_file=other)


def test_mounted_secret_without_a_secrets_file_is_refused_before_building(zoo):
    with pytest.raises(
        ImageBuildError,
        match="mounts the build secret MAD_SECRETS_BUILD_TOKEN .* no secrets file: export MAD_SECRETS_BUILD_TOKEN",
    ):
        plans_for(secret_mount_zoo(zoo), ["build_args"])


def test_build_secret_files_are_owner_only_and_removed_even_when_the_build_fails(tmp_path):
    seen = {}
    with pytest.raises(RuntimeError):
        with build_secret_files({"MAD_SECRETS_A": "value-a-123456"}, base_dir=str(tmp_path)) as paths:
            path = Path(paths["MAD_SECRETS_A"])
            seen.update(
                content=path.read_text(),
                mode=stat.S_IMODE(path.stat().st_mode),
                dir_mode=stat.S_IMODE(path.parent.stat().st_mode),
            )
            raise RuntimeError("the build failed")
    assert seen == {"content": "value-a-123456", "mode": 0o600, "dir_mode": 0o700}
    assert os.listdir(tmp_path) == []


def test_two_cards_producing_one_image_name_are_refused(tmp_path):
    zoo = make_model_zoo(tmp_path / "zoo")
    cards = [{"name": "a.b", "dockerfile": "docker/dummy"}, {"name": "A.B", "dockerfile": "docker/dummy"}]
    with pytest.raises(ImageBuildError, match="models 'a.b' and 'A.B' would both build image ci-a.b_dummy.ubuntu.amd"):
        plan_image_builds(zoo, cards, AMD, zoo / "logs")


# --- building and reusing ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(private_dockerd, tmp_path_factory):
    """The dummy card's AMD image, built once for this module's tests."""
    zoo = make_model_zoo(tmp_path_factory.mktemp("built") / "zoo")
    [plan] = plans_for(zoo, ["dummy"])
    return zoo, plan, ensure_image(plan, env=private_dockerd.env)


def test_build_produces_the_named_image_with_the_fingerprint_label(private_dockerd, built):
    _, plan, outcome = built
    image_id, labels = inspect_image(plan.image_name, private_dockerd.env)
    assert outcome.action == "built" and outcome.image_id == image_id
    assert labels[FINGERPRINT_LABEL] == plan.fingerprint


def test_build_streams_its_log_to_the_log_file(built):
    _, plan, _ = built
    log = open(plan.log_file).read()
    assert log.startswith("# model dummy: docker build --network=host -t ci-dummy_dummy.ubuntu.amd")
    assert "COPY busybox /bin/busybox" in log


def test_image_with_the_same_fingerprint_is_reused(private_dockerd, built):
    zoo, plan, first = built
    [again] = plans_for(zoo, ["dummy"])
    outcome = ensure_image(again, env=private_dockerd.env)
    assert (outcome.action, outcome.image_id, outcome.reason) == (
        "reused",
        first.image_id,
        "image ci-dummy_dummy.ubuntu.amd has the same build fingerprint",
    )


def test_check_mode_reports_the_build_without_building(private_dockerd, zoo):
    [plan] = plans_for(zoo, ["dummy_multi"])
    outcome = ensure_image(plan, env=private_dockerd.env, check_mode=True)
    assert (outcome.action, outcome.image_id) == ("would_build", None)
    images = private_dockerd.docker("images", "-q", "--filter", f"label={FINGERPRINT_LABEL}={plan.fingerprint}")
    assert images.stdout == ""


def test_changed_dockerfile_is_rebuilt_and_says_why(private_dockerd, tmp_path):
    zoo = make_model_zoo(tmp_path / "zoo")
    [plan] = plans_for(zoo, ["dummy_multi"])
    first = ensure_image(plan, env=private_dockerd.env)
    dockerfile = zoo / "docker" / "dummy.ubuntu.amd.Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("echo AMD", "echo AMD-2"))
    [changed] = plans_for(zoo, ["dummy_multi"])
    outcome = ensure_image(changed, env=private_dockerd.env)
    assert outcome.action == "built" and outcome.image_id != first.image_id
    assert (
        outcome.reason == f"image ci-dummy_multi_dummy.ubuntu.amd was built from other inputs "
        f"(fingerprint {plan.fingerprint})"
    )


def test_failed_build_reports_the_log_tail(private_dockerd, tmp_path):
    zoo = make_model_zoo(tmp_path / "zoo")
    (zoo / "docker" / "dummy.ubuntu.amd.Dockerfile").write_text(
        'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "false"]\n'
    )
    [plan] = plans_for(zoo, ["dummy"])
    with pytest.raises(ImageBuildError) as error:
        ensure_image(plan, env=private_dockerd.env)
    message = str(error.value)
    assert f"docker build of ci-dummy_dummy.ubuntu.amd from {plan.dockerfile} failed" in message
    assert plan.log_file in message and "/bin/busybox" in message


def test_secret_mount_build_sees_the_secret_and_leaves_no_trace_of_it(private_dockerd, tmp_path):
    zoo = secret_mount_zoo(make_model_zoo(tmp_path / "zoo"))
    [plan] = plans_for(zoo, ["build_args"], secrets_file=secrets_file(tmp_path))
    outcome = ensure_image(plan, env=private_dockerd.env, buildkit_cli=buildkit_docker_cli())
    seen = private_dockerd.docker("run", "--rm", "--network=none", outcome.image_id, "cat", "/build_token.sha256")
    assert seen.stdout.strip() == hashlib.sha256(BUILD_SECRET.encode()).hexdigest()
    history = private_dockerd.docker("history", "--no-trunc", outcome.image_id).stdout
    assert "sha256sum /run/secrets/MAD_SECRETS_BUILD_TOKEN" in history  # the step is there, its secret is not
    for trace in (
        history,
        private_dockerd.docker("image", "inspect", outcome.image_id).stdout,
        Path(plan.log_file).read_text(),
    ):
        assert BUILD_SECRET not in trace
    assert not list(Path("/dev/shm").glob("slurm-multi-build-secrets-*"))


def test_buildkit_build_with_a_cli_lacking_buildkit_says_what_to_install(private_dockerd, tmp_path):
    zoo = secret_mount_zoo(make_model_zoo(tmp_path / "zoo"))
    [plan] = plans_for(zoo, ["build_args"], secrets_file=secrets_file(tmp_path))
    cli = docker_cli_without_buildkit()
    if cli is None:  # every CLI here has BuildKit: one that says what a CLI 23+ without buildx says
        cli = tmp_path / "docker-without-buildx"
        cli.write_text(
            "#!/bin/sh\necho 'ERROR: BuildKit is enabled but the buildx component is missing or broken.' >&2\nexit 1\n"
        )
        cli.chmod(0o755)
    with pytest.raises(
        ImageBuildError,
        match=r"needs BuildKit, and the docker CLI .* has no BuildKit: install its "
        r"buildx component .* or set buildkit_docker_cli",
    ):
        ensure_image(plan, env=private_dockerd.env, buildkit_cli=str(cli))


def test_push_to_an_unreachable_registry_says_what_to_check(private_dockerd, built):
    _, plan, _ = built
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    remote = f"127.0.0.1:{port}/slurm-multi-test:ci-dummy_dummy.ubuntu.amd"
    with pytest.raises(
        ImageBuildError, match=rf"docker push {remote} failed .*needs a login, give its credentials \(credentials_file"
    ):
        push_image(plan.image_name, remote, plan.log_file, env=private_dockerd.env)


# --- manifest entries --------------------------------------------------------------------------------------------


def test_manifest_entry_has_mads_keys_and_ours(built):
    _, plan, outcome = built
    entry = manifest_image_entry(outcome)
    assert {
        "docker_image",
        "dockerfile",
        "base_docker",
        "docker_sha",
        "build_duration",
        "build_command",
        "log_file",
    } <= set(entry)
    assert (entry["image_id"], entry["build_fingerprint"]) == (outcome.image_id, plan.fingerprint)


def test_reused_image_keeps_its_previous_manifest_entry(private_dockerd, built):
    zoo, plan, first = built
    previous = record_builds([first], AMD)
    reused = ensure_image(plan, env=private_dockerd.env)
    assert record_builds([reused], AMD, previous_manifest=previous) == previous


# --- base images: a base that moved is never run stale -------------------------------------------------------------


def moved_base_dockerfile(base):
    """The dummy card's Dockerfile over `base` (MAD's `ARG BASE_DOCKER`), printing the version its base holds."""
    return (
        f"# CONTEXT {{'gpu_vendor': 'AMD', 'guest_os': 'UBUNTU'}}\nARG BASE_DOCKER={base}\nFROM $BASE_DOCKER\n"
        'CMD ["cat", "/base-version"]\n'
    )


def _base(private_dockerd, tag, version):
    """Build (again) the base `tag`, holding `version` in /base-version; its image ID."""
    return build_busybox_image(private_dockerd, tag, f"RUN echo {version} > /base-version\n")


@pytest.fixture
def moved_base(private_dockerd, tmp_path):
    """(zoo, base tag, its first ID, the outcome of the dummy card built over it): a base of this test's own."""
    tag = f"slurm-multi-test/moved-base:{uuid.uuid4().hex[:8]}"
    first_id = _base(private_dockerd, tag, 111)
    zoo = make_model_zoo(tmp_path / "zoo")
    (zoo / "docker" / "dummy.ubuntu.amd.Dockerfile").write_text(moved_base_dockerfile(tag))
    [plan] = plans_for(zoo, ["dummy"])
    first = ensure_image(plan, env=private_dockerd.env)
    assert first.action == "built" and first.plan.base_images == {tag: first_id}
    yield zoo, tag, first_id, first
    private_dockerd.docker("rmi", "-f", tag, first.plan.image_name, check=False)


def test_an_image_over_a_base_rebuilt_under_the_same_tag_is_built_again_over_the_new_base(private_dockerd, moved_base):
    zoo, tag, _, first = moved_base
    new_id = _base(private_dockerd, tag, 222)
    [plan] = plans_for(zoo, ["dummy"])
    outcome = ensure_image(plan, env=private_dockerd.env)
    assert outcome.action == "built" and outcome.image_id != first.image_id
    assert outcome.reason.endswith(f"its base images now: {tag} = {new_id}")
    assert private_dockerd.docker("run", "--rm", "--network=none", outcome.image_id).stdout == "222\n"


def test_the_manifest_entry_names_the_base_image_and_the_id_the_build_used(private_dockerd, moved_base):
    _, tag, first_id, first = moved_base
    entry = manifest_image_entry(first)
    assert (entry["base_docker"], entry["docker_sha"], entry["base_images"]) == (tag, first_id, {tag: first_id})


def test_an_image_over_an_unchanged_base_is_reused(private_dockerd, moved_base):
    zoo, _, _, first = moved_base
    [plan] = plans_for(zoo, ["dummy"])
    assert ensure_image(plan, env=private_dockerd.env)[1:3] == ("reused", first.image_id)


def test_a_base_the_daemon_lacks_and_cannot_pull_fails_naming_it(private_dockerd, tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        base = f"127.0.0.1:{closed.getsockname()[1]}/nobody/base:1"
    zoo = make_model_zoo(tmp_path / "zoo")
    (zoo / "docker" / "dummy.ubuntu.amd.Dockerfile").write_text(moved_base_dockerfile(base))
    [plan] = plans_for(zoo, ["dummy"])
    with pytest.raises(ImageBuildError, match=rf"builds on {base}, which this node's daemon does not have, and `doc"):
        ensure_image(plan, env=private_dockerd.env)


def test_check_mode_pulls_no_missing_base_and_says_the_build_would(private_dockerd, tmp_path):
    zoo = make_model_zoo(tmp_path / "zoo")
    base = f"slurm-multi-test/absent-base:{uuid.uuid4().hex[:8]}"
    (zoo / "docker" / "dummy.ubuntu.amd.Dockerfile").write_text(moved_base_dockerfile(base))
    [plan] = plans_for(zoo, ["dummy"])
    outcome = ensure_image(plan, env=private_dockerd.env, check_mode=True)
    assert (outcome.action, outcome.reason) == (
        "would_build",
        f"base image {base} is not on this node's daemon: the build would pull it",
    )
    assert not os.path.exists(plan.log_file)
