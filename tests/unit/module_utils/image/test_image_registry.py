"""Registry mode by digest, against a real Docker daemon and a real registry (Debian's docker-registry) on loopback."""

import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    ensure_image,
    plan_image_builds,
    push_image,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_model_cards,
    select_model_cards,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry import (
    ImageRegistryError,
    pull_image,
    pulled_digest,
    pushed_digest,
)
from slurm_multi.lab.cluster import registry_answers, registry_config
from tests.support.dockerd import build_busybox_image
from tests.support.lab.model_zoo import make_model_zoo

DIGEST_A = "sha256:" + "a1" * 32
DIGEST_B = "sha256:" + "b2" * 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """`127.0.0.1:PORT` of a docker-registry of this module's own, stopped (by its pid) at the end."""
    root = tmp_path_factory.mktemp("registry")
    port = _free_port()
    config = root / "config.yml"
    config.write_text(registry_config(root / "storage", "127.0.0.1", port))
    with open(root / "registry.log", "wb") as log:
        process = subprocess.Popen(
            ["/usr/bin/docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while not registry_answers("127.0.0.1", port):
            assert process.poll() is None and time.monotonic() < deadline, (root / "registry.log").read_text()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture(scope="module")
def two_images(private_dockerd):
    """(ID of image A, ID of image B): two small images that differ (B has a label)."""
    a = build_busybox_image(private_dockerd, "slurm-multi-test/variant:a", "LABEL variant=a\n")
    b = build_busybox_image(private_dockerd, "slurm-multi-test/variant:b", "LABEL variant=b\n")
    assert a != b
    return a, b


def _forget(dockerd, image_id):
    """Remove an image and every name of it from the daemon, as on a worker that never had it."""
    dockerd.docker("image", "rm", "-f", image_id, check=False)
    assert dockerd.docker("image", "inspect", image_id, check=False).returncode != 0


# --- digests in the CLI's output ---------------------------------------------------------------------------------


def test_the_pushed_digest_is_the_last_one_docker_push_reported():
    output = (
        "The push refers to repository [127.0.0.1:5000/ns]\n58ed1d111bb2: Pushed\n"
        f"old: digest: {DIGEST_B} size: 943\nci-m_m: digest: {DIGEST_A} size: 943\n"
    )
    assert pushed_digest(output) == DIGEST_A
    assert pushed_digest("58ed1d111bb2: Pushed\n") is None


def test_the_pulled_digest_is_the_one_docker_pull_reported():
    output = f"ci-m_m: Pulling from ns\nDigest: {DIGEST_A}\nStatus: Downloaded newer image for 127.0.0.1:5000/ns:x\n"
    assert pulled_digest(output) == DIGEST_A
    assert pulled_digest("Status: Image is up to date\n") is None


# --- push and pull on a real registry ------------------------------------------------------------------------------


def test_push_returns_the_image_by_the_digest_docker_recorded(private_dockerd, registry, two_images, tmp_path):
    remote = f"{registry}/ns:push-a"
    pinned = push_image("slurm-multi-test/variant:a", remote, str(tmp_path / "build.log"), env=private_dockerd.env)
    assert pinned.startswith(f"{registry}/ns@sha256:")
    repo_digests = private_dockerd.docker("image", "inspect", "--format", "{{json .RepoDigests}}", remote).stdout
    assert pinned in repo_digests


def test_a_tag_moved_after_the_push_does_not_change_what_the_digest_pulls(
    private_dockerd, registry, two_images, tmp_path
):
    image_a, image_b = two_images
    tag = f"{registry}/ns:moved"
    pinned_a = push_image("slurm-multi-test/variant:a", tag, str(tmp_path / "a.log"), env=private_dockerd.env)
    push_image("slurm-multi-test/variant:b", tag, str(tmp_path / "b.log"), env=private_dockerd.env)  # the tag moves
    _forget(private_dockerd, image_a)  # a worker that does not hold rank 0's image yet
    pulled = pull_image(pinned_a, host=private_dockerd.host)
    assert (pulled.reference, pulled.image_id, pulled.action) == (pinned_a, image_a, "pulled")
    by_tag = pull_image(tag, host=private_dockerd.host)
    assert by_tag.image_id == image_b, "the tag should name the other image now: the test did not move it"
    private_dockerd.docker("tag", image_a, "slurm-multi-test/variant:a")


def test_an_image_the_node_holds_by_digest_is_not_pulled_again(private_dockerd, registry, two_images, tmp_path):
    image_a, _ = two_images
    pinned = push_image(
        "slurm-multi-test/variant:a", f"{registry}/ns:held", str(tmp_path / "a.log"), env=private_dockerd.env
    )
    assert pull_image(pinned, host=private_dockerd.host) == (pinned, image_a, "already-present")


def test_a_tag_is_pulled_and_pinned_to_the_digest_it_got(private_dockerd, registry, two_images, tmp_path):
    image_a, _ = two_images
    tag = f"{registry}/ns:pin-me"
    pinned = push_image("slurm-multi-test/variant:a", tag, str(tmp_path / "a.log"), env=private_dockerd.env)
    pulled = pull_image(tag, host=private_dockerd.host)
    assert (pulled.reference, pulled.image_id) == (pinned, image_a)


def test_check_mode_pulls_nothing(private_dockerd, registry, two_images, tmp_path):
    image_a, _ = two_images
    pinned = push_image(
        "slurm-multi-test/variant:a", f"{registry}/ns:check", str(tmp_path / "a.log"), env=private_dockerd.env
    )
    _forget(private_dockerd, image_a)
    assert pull_image(pinned, host=private_dockerd.host, check_mode=True) == (pinned, None, "would-pull")
    assert private_dockerd.docker("image", "inspect", image_a, check=False).returncode != 0
    pull_image(pinned, host=private_dockerd.host)
    private_dockerd.docker("tag", image_a, "slurm-multi-test/variant:a")


def test_a_digest_the_registry_does_not_have_is_a_clear_error(private_dockerd, registry):
    with pytest.raises(
        ImageRegistryError,
        match=rf"docker pull {registry}/ns@{DIGEST_B} failed .*needs a login, that the job has its credentials",
    ):
        pull_image(f"{registry}/ns@{DIGEST_B}", host=private_dockerd.host)


# --- a model image's base, pulled by the build -------------------------------------------------------------------


def test_a_base_the_daemon_lacks_is_pulled_before_the_build_and_counted_by_the_id_pulled(
    private_dockerd, registry, tmp_path
):
    base = f"{registry}/slurm-multi-test/pulled-base:{uuid.uuid4().hex[:8]}"
    base_id = build_busybox_image(private_dockerd, base, "RUN echo 333 > /base-version\n")
    private_dockerd.docker("push", base)
    private_dockerd.docker("image", "rm", base)  # a node whose daemon never had the base
    zoo = make_model_zoo(tmp_path / "zoo")
    (zoo / "docker" / "dummy.ubuntu.amd.Dockerfile").write_text(
        f"# CONTEXT {{'gpu_vendor': 'AMD'}}\nARG BASE_DOCKER={base}\nFROM $BASE_DOCKER\n"
    )
    cards = select_model_cards(load_model_cards(zoo / "models.json"), ["dummy"])
    [plan] = plan_image_builds(zoo, cards, {"gpu_vendor": "AMD"}, zoo / "logs")
    outcome = ensure_image(plan, env=private_dockerd.env)
    assert outcome.action == "built" and outcome.plan.base_images == {base: base_id}
    log = Path(plan.log_file).read_text()  # the pull and the build, one after the other
    assert f"# base image {base} is not on this node's daemon: docker pull {base}\n" in log
    assert log.index("docker pull") < log.index("# model dummy: docker build")
    private_dockerd.docker("image", "rm", "-f", plan.image_name, base, check=False)
