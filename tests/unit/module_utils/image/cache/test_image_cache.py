"""The shared image tar cache against real Docker daemons: rank 0's (the session's private daemon) and a worker's
(a second private daemon of this module), with real `docker save` and `docker load`."""

import base64
import getpass
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, image_id, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache import entries as image_cache_entries
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache import publish as image_cache_publish
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    ImageCacheError,
    entry_key,
    prune_entries,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PushTarget
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import RebuildRecipe
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    FINGERPRINT_LABEL,
    build_fingerprint,
)
from tests.support.dockerd import build_busybox_image


@pytest.fixture(scope="module")
def foreign_image(private_dockerd):
    """(tag, image_id) of another image than busybox_image, on rank 0's daemon."""
    tag = "slurm-multi-test/foreign:latest"
    return tag, build_busybox_image(private_dockerd, tag, extra_dockerfile="LABEL purpose=foreign\n")


@pytest.fixture
def cache_dir(tmp_path):
    path = tmp_path / "docker-builds"
    path.mkdir()
    path.chmod(0o755)
    return path


@pytest.fixture
def rank0(private_dockerd, cache_dir):
    return CacheDirectory(str(cache_dir), docker_host=private_dockerd.host)


@pytest.fixture
def worker(worker_dockerd, cache_dir, busybox_image, foreign_image):
    """The worker's view of the cache; its daemon starts each test without rank 0's images."""
    for _, announced_id in (busybox_image, foreign_image):
        worker_dockerd.docker("rmi", "-f", announced_id, check=False)
    return CacheDirectory(str(cache_dir), docker_host=worker_dockerd.host)


def images_on(daemon):
    return set(daemon.docker("images", "-a", "-q", "--no-trunc").stdout.split())


def sha256_of(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def entry_files(cache_dir):
    """The entries' files (not the blob dir, where a push target's uploads go)."""
    return sorted(name for name in os.listdir(cache_dir) if name != "blobs")


# -- publish ---------------------------------------------------------------------------------------------------


def test_publish_commits_the_tar_and_a_marker_describing_it(rank0, cache_dir, busybox_image):
    tag, announced_id = busybox_image
    result = publish_image(rank0, tag)

    key = announced_id.split(":", 1)[1]
    assert (result.action_taken, result.changed, result.image_id) == ("saved", True, announced_id)
    assert entry_files(cache_dir) == [key + ".json", key + ".tar"]
    marker = json.loads((cache_dir / (key + ".json")).read_text())
    assert marker["image_id"] == announced_id
    assert marker["tags"] == [tag]
    assert marker["size"] == (cache_dir / (key + ".tar")).stat().st_size == result.bytes
    assert marker["sha256"] == sha256_of(cache_dir / (key + ".tar"))
    assert marker["publisher"] and marker["created"]


def test_publish_of_a_committed_entry_changes_nothing_but_leases_it(rank0, cache_dir, busybox_image):
    publish_image(rank0, busybox_image[0])
    key = entry_key(busybox_image[1])
    before = (cache_dir / (key + ".tar")).stat()
    for name in (key + ".tar", key + ".json"):
        os.utime(cache_dir / name, (before.st_atime - DAY, before.st_mtime - DAY))

    result = publish_image(rank0, busybox_image[0])

    assert (result.action_taken, result.changed) == ("already-present", False)
    after = (cache_dir / (key + ".tar")).stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    # In use again: prune's age rule counts from now, for the marker and the tar alike (entries.lease).
    assert all(time.time() - (cache_dir / name).stat().st_mtime < 60 for name in (key + ".tar", key + ".json"))


def test_publish_replaces_a_committed_entry_whose_tar_has_the_wrong_size(rank0, cache_dir, busybox_image):
    publish_image(rank0, busybox_image[0])
    tar = cache_dir / (entry_key(busybox_image[1]) + ".tar")
    os.truncate(tar, 4096)

    result = publish_image(rank0, busybox_image[0])

    marker = json.loads((cache_dir / (entry_key(busybox_image[1]) + ".json")).read_text())
    assert (result.action_taken, result.changed) == ("saved", True)
    assert tar.stat().st_size == marker["size"] and sha256_of(tar) == marker["sha256"]


@pytest.fixture
def permissive_umask():
    """umask 0 while the test runs: a mode seen afterwards is the one the code asked for, not the umask's."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def mode_of(path):
    return os.stat(path).st_mode & 0o777


def test_publish_creates_a_missing_cache_dir_and_its_parents_owner_only(
    private_dockerd, tmp_path, busybox_image, permissive_umask
):
    cache_dir = tmp_path / "shared" / "builds"
    existing_parent_mode = mode_of(tmp_path)

    publish_image(CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), busybox_image[0])

    assert cache_dir.is_dir() and (mode_of(cache_dir), mode_of(cache_dir.parent)) == (0o700, 0o700)
    assert mode_of(tmp_path) == existing_parent_mode  # a parent that existed is not ours to change


def test_published_tar_and_marker_are_readable_by_their_owner_only(rank0, cache_dir, busybox_image, permissive_umask):
    publish_image(rank0, busybox_image[0])

    key = entry_key(busybox_image[1])
    assert (mode_of(cache_dir / (key + ".tar")), mode_of(cache_dir / (key + ".json"))) == (0o600, 0o600)
    assert mode_of(cache_dir) == 0o755  # an existing cache dir keeps the mode its owner gave it


def test_an_owner_only_entry_still_loads_on_a_worker(rank0, worker, worker_dockerd, busybox_image):
    publish_image(rank0, busybox_image[0])

    result = load_image(worker, busybox_image[1])

    assert result.action_taken == "loaded" and busybox_image[1] in images_on(worker_dockerd)


def test_publish_of_an_image_the_daemon_lacks_says_so(rank0):
    with pytest.raises(ImageCacheError, match="not on this node's Docker daemon"):
        publish_image(rank0, "slurm-multi-test/never-built:latest")


def test_publish_without_enough_free_space_names_needed_and_available_bytes(
    rank0, cache_dir, busybox_image, monkeypatch
):
    monkeypatch.setattr(image_cache_publish, "FREE_SPACE_SLACK_BYTES", 1 << 60)

    with pytest.raises(ImageCacheError, match=r"bytes needed .* available") as raised:
        publish_image(rank0, busybox_image[0])

    assert str(cache_dir) in str(raised.value)
    assert entry_files(cache_dir) == []


@pytest.fixture
def tiny_cache_dir(tmp_path):
    """A cache dir on a 256 KiB tmpfs of its own (root only), smaller than any image's tar."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint / "cache"
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_a_filesystem_filling_up_during_publish_is_a_clear_error_and_leaves_no_entry(
    private_dockerd, tiny_cache_dir, busybox_image, monkeypatch
):
    # As if another job filled the filesystem after the free-space check: that check passes, the writes fail.
    monkeypatch.setattr(image_cache_publish, "FREE_SPACE_FACTOR", 0)
    monkeypatch.setattr(image_cache_publish, "FREE_SPACE_SLACK_BYTES", 0)

    with pytest.raises(ImageCacheError, match=r"No space left on device\. Free space there") as raised:
        publish_image(CacheDirectory(str(tiny_cache_dir), docker_host=private_dockerd.host), busybox_image[0])

    assert f"cannot write the cache entry for {busybox_image[0]} in {tiny_cache_dir}" in str(raised.value)
    assert entry_files(tiny_cache_dir) == []  # neither an entry nor a temporary file


def test_concurrent_publishers_of_one_image_leave_one_valid_entry(private_dockerd, cache_dir, busybox_image):
    start = threading.Barrier(4)
    results, errors = [], []

    def publish():
        start.wait()
        try:
            results.append(
                publish_image(CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), busybox_image[0])
            )
        except Exception as err:  # noqa: BLE001 - collected and asserted on below
            errors.append(err)

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    key = entry_key(busybox_image[1])
    assert errors == []
    assert any(result.changed for result in results)
    assert entry_files(cache_dir) == [key + ".json", key + ".tar"]
    marker = json.loads((cache_dir / (key + ".json")).read_text())
    assert sha256_of(cache_dir / (key + ".tar")) == marker["sha256"]


# -- cache directory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_dir_writable_by_other_users_is_refused(rank0, cache_dir, busybox_image, mode):
    cache_dir.chmod(mode)

    with pytest.raises(ImageCacheError, match="writable by other users.*chmod go-w"):
        publish_image(rank0, busybox_image[0])


def test_a_worker_loads_nothing_from_a_world_writable_cache_dir(
    rank0, worker, worker_dockerd, cache_dir, busybox_image
):
    publish_image(rank0, busybox_image[0])
    cache_dir.chmod(0o777)

    with pytest.raises(ImageCacheError, match="writable by other users"):
        load_image(worker, busybox_image[1], marker_wait=0)

    assert busybox_image[1] not in images_on(worker_dockerd)


def test_a_cache_dir_owned_by_another_user_is_refused(rank0, cache_dir, busybox_image):
    os.chown(cache_dir, 4242, -1)

    with pytest.raises(ImageCacheError, match=r"owned by (\S+ \()?uid 4242"):
        publish_image(rank0, busybox_image[0])


def test_the_environment_overrides_the_cache_dir_option():
    chosen = image_cache_entries.resolve_cache_dir("/from/option", {"MAD_DOCKER_BUILDS": "/from/env"})

    assert chosen == "/from/env"


def test_a_cache_dir_with_percent_u_is_per_user_so_no_other_user_can_take_it_first(monkeypatch):
    default = "/tmp/slurm-multi-image-cache-%u"  # as a site whose /tmp its nodes share sets it (the lab's site.yml)
    assert image_cache_entries.resolve_cache_dir(default, {}) == f"/tmp/slurm-multi-image-cache-{getpass.getuser()}"
    monkeypatch.setattr(image_cache_entries.os, "geteuid", lambda: 65534)
    assert image_cache_entries.resolve_cache_dir(default, {}) == "/tmp/slurm-multi-image-cache-nobody"
    monkeypatch.setattr(image_cache_entries.os, "geteuid", lambda: 4242)  # no passwd entry: its number
    assert image_cache_entries.resolve_cache_dir(default, {}) == "/tmp/slurm-multi-image-cache-4242"


# -- load ------------------------------------------------------------------------------------------------------


def test_load_gives_a_worker_the_announced_image_and_its_tag(rank0, worker, worker_dockerd, busybox_image):
    tag, announced_id = busybox_image
    publish_image(rank0, tag)

    result = load_image(worker, announced_id)

    assert (result.action_taken, result.changed, result.image_id) == ("loaded", True, announced_id)
    assert image_id(tag, host=worker_dockerd.host) == announced_id


def test_load_on_a_worker_that_has_the_image_changes_nothing(rank0, worker, busybox_image):
    publish_image(rank0, busybox_image[0])
    load_image(worker, busybox_image[1])

    result = load_image(worker, busybox_image[1], image=busybox_image[0])

    assert (result.action_taken, result.changed) == ("already-present", False)


def test_load_points_a_moved_tag_back_at_the_announced_image(
    rank0, worker, worker_dockerd, busybox_image, foreign_image
):
    publish_image(rank0, busybox_image[0])
    publish_image(rank0, foreign_image[0])
    load_image(worker, busybox_image[1])
    load_image(worker, foreign_image[1])
    worker_dockerd.docker("tag", foreign_image[1], busybox_image[0])

    result = load_image(worker, busybox_image[1], image=busybox_image[0])

    assert (result.action_taken, result.changed) == ("tagged", True)
    assert image_id(busybox_image[0], host=worker_dockerd.host) == busybox_image[1]


@pytest.mark.parametrize("cut", ["half", "end-of-archive"])
def test_a_truncated_tar_is_reported_and_nothing_is_loaded(
    rank0, worker, worker_dockerd, cache_dir, busybox_image, cut
):
    # Without its last 1024 bytes (the end-of-archive blocks) a tar is one that `docker load` alone accepts.
    publish_image(rank0, busybox_image[0])
    tar = cache_dir / (entry_key(busybox_image[1]) + ".tar")
    os.truncate(tar, tar.stat().st_size // 2 if cut == "half" else tar.stat().st_size - 1024)
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match="is damaged or holds another image") as raised:
        load_image(worker, busybox_image[1], marker_wait=0)

    assert str(tar) in str(raised.value)
    assert images_on(worker_dockerd) == before


def test_a_tar_of_another_image_under_an_entry_name_is_reported_and_not_loaded(
    rank0, worker, worker_dockerd, cache_dir, busybox_image, foreign_image, private_dockerd
):
    publish_image(rank0, busybox_image[0])
    tar = cache_dir / (entry_key(busybox_image[1]) + ".tar")
    with open(tar, "wb") as planted:
        subprocess.run(["docker", "save", foreign_image[0]], env=private_dockerd.env, stdout=planted, check=True)
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match="is damaged or holds another image") as raised:
        load_image(worker, busybox_image[1], marker_wait=0)

    assert str(tar) in str(raised.value)
    assert images_on(worker_dockerd) == before
    assert image_id(foreign_image[0], host=worker_dockerd.host) is None


@pytest.fixture(scope="module")
def model_image(private_dockerd, busybox_image):
    """(tag, image_id) of a model's image: one small layer over busybox_image, as a model's over its base."""
    tag = "slurm-multi-test/model:latest"
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "Dockerfile").write_text(f"FROM {busybox_image[0]}\nRUN echo model > /model.txt\n")
        private_dockerd.docker("build", "--network=host", "-q", "-t", tag, context)
    return tag, private_dockerd.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()


def layer_members(tar):
    """The layer files of a `docker save` tar, base first (its manifest's order)."""
    with tarfile.open(tar) as saved:
        members = {member.name: member for member in saved}
        (manifest,) = json.load(saved.extractfile("manifest.json"))
    return [members[name] for name in manifest["Layers"]]


def flip_byte(path, offset):
    """Flip one byte in place: the file keeps its size, so only a digest can tell."""
    with open(path, "r+b") as entry:
        entry.seek(offset)
        byte = entry.read(1)
        entry.seek(offset)
        entry.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def base_on_the_worker(private_dockerd, worker, worker_dockerd, cache_dir, tmp_path, busybox_image, model_image):
    """The model's entry published whole (the cache holds none of its layers), its base (busybox_image) already on
    the worker - brought through another cache - the model not; the entry's tar."""
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    publish_image(CacheDirectory(str(elsewhere), docker_host=private_dockerd.host), busybox_image[0])
    load_image(CacheDirectory(str(elsewhere), docker_host=worker_dockerd.host), busybox_image[1])
    assert (
        publish_image(CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), model_image[0]).action_taken
        == "saved"
    )
    return cache_dir / (entry_key(model_image[1]) + ".tar")


def test_a_worker_holding_the_base_loads_only_the_models_layer(worker, worker_dockerd, model_image, base_on_the_worker):
    result = load_image(worker, model_image[1], image=model_image[0])

    assert (result.action_taken, result.details["layers_loaded"]) == ("loaded", 1)
    *base, model = layer_members(base_on_the_worker)
    assert result.bytes == model.size < sum(layer.size for layer in base)  # the model's layer, never the base's
    assert image_id(model_image[0], host=worker_dockerd.host) == model_image[1]
    run = worker_dockerd.docker("run", "--rm", model_image[1], "cat", "/model.txt")
    assert run.stdout == "model\n"


def test_a_worker_without_the_base_loads_every_layer(rank0, worker, worker_dockerd, cache_dir, model_image):
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    publish_image(rank0, model_image[0])

    result = load_image(worker, model_image[1])

    layers = layer_members(cache_dir / (entry_key(model_image[1]) + ".tar"))
    assert (result.details["layers_loaded"], result.bytes) == (len(layers), sum(layer.size for layer in layers))
    assert image_id(model_image[1], host=worker_dockerd.host) == model_image[1]


def test_a_flipped_byte_in_a_layer_the_worker_takes_is_refused_and_nothing_is_loaded(
    worker, worker_dockerd, model_image, base_on_the_worker
):
    tar = base_on_the_worker
    top = layer_members(tar)[-1]
    flip_byte(tar, top.offset_data + top.size // 2)
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match="does not hash to sha256:") as raised:
        load_image(worker, model_image[1], marker_wait=0)

    assert str(tar) in str(raised.value) and "publish again" in str(raised.value)
    assert images_on(worker_dockerd) == before


# -- layered entries: rank 0 publishes only the layers the cache lacks -------------------------------------------


@pytest.fixture(scope="module")
def base_with_a_registry_digest(private_dockerd, busybox_image, tmp_path_factory):
    """busybox_image as a base pulled from a registry is to its daemon: each layer known by a blob digest (here from
    one push to a throwaway target; the field's bases come with theirs from their registry)."""
    target_dir = tmp_path_factory.mktemp("registry")
    with PushTarget(str(target_dir), busybox_image[1], upload_cap=1 << 30) as target, target.docker_config() as env:
        reference = target.reference("base")
        private_dockerd.docker("tag", busybox_image[1], reference)
        pushing = {**private_dockerd.env, **env}  # the target's credential, as publish.py gives it
        subprocess.run(["docker", "push", reference], env=pushing, check=True, capture_output=True)
        private_dockerd.docker("image", "rm", "--no-prune", reference)
    return busybox_image


@pytest.fixture
def model_over_a_published_base(rank0, worker_dockerd, cache_dir, base_with_a_registry_digest, model_image):
    """The base published whole, then the model over it: (the model's publish result, its marker)."""
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    publish_image(rank0, base_with_a_registry_digest[0])
    published = publish_image(rank0, model_image[0])
    return published, json.loads((cache_dir / (entry_key(model_image[1]) + ".json")).read_text())


def blob_size(cache_dir, digest):
    return (cache_dir / "blobs" / digest.split(":")[1]).stat().st_size


def test_a_model_over_a_published_base_publishes_only_its_own_layer(
    cache_dir, busybox_image, model_image, model_over_a_published_base
):
    published, marker = model_over_a_published_base

    base_key = entry_key(busybox_image[1])
    assert (published.action_taken, published.details["layers_published"]) == ("pushed", 1)
    *base, model = marker["layers"]
    assert [layer["entry"] for layer in base] == [base_key] * len(base)
    assert published.bytes == blob_size(cache_dir, model["blob"]) + blob_size(cache_dir, model_image[1])
    assert published.bytes < (cache_dir / (base_key + ".tar")).stat().st_size / 100
    assert sorted(os.listdir(cache_dir / "blobs")) == sorted([model["blob"][7:], model_image[1][7:]])  # no temp file


def test_the_push_targets_credential_reaches_the_daemon_in_no_argv_and_through_a_private_config_only(
    rank0, cache_dir, base_with_a_registry_digest, model_image, monkeypatch
):
    publish_image(rank0, base_with_a_registry_digest[0])
    calls, targets = [], []
    real_run_docker, real_target = image_cache_publish.run_docker, image_cache_publish.PushTarget

    class Watched(real_target):
        def __enter__(self):
            targets.append(self)
            return super().__enter__()

    def watched(args, **kwargs):
        config = (kwargs.get("extra_env") or {}).get("DOCKER_CONFIG")
        modes = config and (mode_of(config), mode_of(os.path.join(config, "config.json")))
        calls.append((list(args), config, modes))
        return real_run_docker(args, **kwargs)

    monkeypatch.setattr(image_cache_publish, "run_docker", watched)
    monkeypatch.setattr(image_cache_publish, "PushTarget", Watched)

    assert publish_image(rank0, model_image[0]).action_taken == "pushed"

    # One push, or two where this daemon knew the model's layer from an earlier test's push (publish.py).
    passwords = [base64.b64decode(target.authorization.split()[1]).decode().split(":", 1)[1] for target in targets]
    assert all(password not in " ".join(args) for args, _, _ in calls for password in passwords)
    pushes = [(config, modes) for args, config, modes in calls if args[0] == "push"]
    assert len(pushes) == len(targets) and all(modes == (0o700, 0o600) for _, modes in pushes)
    assert not any(os.path.exists(config) for config, _ in pushes)


def test_a_push_past_its_cap_is_stopped_and_the_image_saved_whole(
    rank0, worker, cache_dir, base_with_a_registry_digest, model_image, monkeypatch
):
    publish_image(rank0, base_with_a_registry_digest[0])
    monkeypatch.setattr(image_cache_publish, "PUSH_UPLOAD_CAP_FLOOR_BYTES", 100)
    monkeypatch.setattr(image_cache_publish, "PUSH_UPLOAD_CAP_FRACTION", 0.0)

    published = publish_image(rank0, model_image[0])

    assert published.action_taken == "saved" and published.entry.endswith(".tar")
    assert "over 100 bytes gzipped" in published.details["not_pushed"]
    assert [name for name in os.listdir(cache_dir / "blobs") if name.startswith(".")] == []  # no upload left behind
    assert load_image(worker, model_image[1]).action_taken in ("loaded", "already-present")


@pytest.fixture
def undigested_base_and_model(private_dockerd, tmp_path, busybox_image):
    """(base tag, model tag): a base built on the node, so that its daemon knows it by no registry digest (as after
    `docker load` or `docker import`: the push would gzip it whole), and a model over it."""
    context = tmp_path / "context"
    context.mkdir()
    (context / "base.bin").write_bytes(os.urandom(1 << 20))
    (context / "Dockerfile").write_text(f"FROM {busybox_image[0]}\nCOPY base.bin /base.bin\n")
    tag = f"slurm-multi-test/undigested:{uuid.uuid4().hex[:8]}"
    private_dockerd.docker("build", "--network=host", "-q", "-t", tag + "-base", str(context))
    (context / "Dockerfile").write_text(f"FROM {tag}-base\nRUN echo model > /model.txt\n")
    private_dockerd.docker("build", "--network=host", "-q", "-t", tag, str(context))
    yield tag + "-base", tag
    private_dockerd.docker("rmi", "-f", tag, tag + "-base", check=False)


def test_a_base_the_daemon_knows_by_no_registry_digest_is_taught_one_by_its_first_publish_and_pushed_over_after(
    rank0, cache_dir, undigested_base_and_model
):
    base, model = undigested_base_and_model

    first = publish_image(rank0, base)
    published = publish_image(rank0, model)

    assert (first.action_taken, first.details.get("taught")) == ("saved", True), first.details
    assert (published.action_taken, published.details["layers_published"]) == ("pushed", 1), published.details
    assert published.bytes < 64 << 10  # the model's layer and config, not the 1 MB base
    assert [name for name in os.listdir(cache_dir / "blobs") if name.startswith(".")] == []


def test_a_publish_told_not_to_teach_saves_every_image_over_such_a_base_whole(rank0, undigested_base_and_model):
    base, model = undigested_base_and_model

    first = publish_image(rank0, base, teach=False)
    published = publish_image(rank0, model, teach=False)

    assert "taught" not in first.details and published.action_taken == "saved", published.details
    assert "by no registry digest" in published.details["not_pushed"]


def test_a_daemon_taught_after_its_publish_pushes_the_next_image_over_the_base(rank0, undigested_base_and_model):
    base, model = undigested_base_and_model
    saved = publish_image(rank0, base, teach=False)
    held = publish_image(rank0, base, teach=False)

    taught = image_cache_publish.teach_daemon(rank0, base)
    published = publish_image(rank0, model, teach=False)

    # Worth the lesson once, after the whole save; not when the cache held the image already (every warm job).
    assert (saved.teachable, held.action_taken, held.teachable) == (True, "already-present", False)
    assert taught == {"taught": True}
    assert published.action_taken == "pushed" and not published.teachable, published.details


def test_a_daemon_that_cannot_be_taught_a_digest_gets_the_image_saved_whole(
    rank0, cache_dir, undigested_base_and_model, monkeypatch
):
    """The fallback: a base's upload is refused at its first bytes (those of the base's layer in the cache), never
    gzipped whole, and the image saved."""
    base, model = undigested_base_and_model
    monkeypatch.setattr(image_cache_publish, "teach_layer_digests", lambda *args: "the pull failed")

    first = publish_image(rank0, base)
    published = publish_image(rank0, model)

    assert first.details.get("not_taught") == "the pull failed"
    assert published.action_taken == "saved", published.details
    assert "by no registry digest" in published.details["not_pushed"]
    assert "could not be taught one: the pull failed" in published.details["not_pushed"]
    assert [name for name in os.listdir(cache_dir / "blobs") if name.startswith(".")] == []


def test_a_worker_holding_the_base_loads_only_the_pushed_layer(
    worker, worker_dockerd, cache_dir, busybox_image, model_image, model_over_a_published_base
):
    load_image(worker, busybox_image[1])

    result = load_image(worker, model_image[1], image=model_image[0])

    model = model_over_a_published_base[1]["layers"][-1]
    assert (result.details["layers_loaded"], result.bytes) == (1, blob_size(cache_dir, model["blob"]))
    assert worker_dockerd.docker("run", "--rm", model_image[0], "cat", "/model.txt").stdout == "model\n"


def test_a_worker_without_the_base_takes_it_from_its_entry_and_the_model_from_its_blob(
    worker, worker_dockerd, cache_dir, model_image, model_over_a_published_base
):
    long_ago = time.time() - 30 * DAY
    for path in [*cache_dir.iterdir(), *(cache_dir / "blobs").iterdir()]:
        os.utime(path, (long_ago, long_ago))

    result = load_image(worker, model_image[1])

    # Every file the load read is leased (in use from now on): no prune removes it under a job.
    marker = model_over_a_published_base[1]
    used = [entry_key(model_image[1]) + ".json", "blobs/" + entry_key(model_image[1])]
    used += [
        f"{layer['entry']}.json" if "entry" in layer else "blobs/" + layer["blob"][7:] for layer in marker["layers"]
    ]
    assert all((cache_dir / name).stat().st_mtime > long_ago + DAY for name in used), used

    assert result.details["layers_loaded"] == len(model_over_a_published_base[1]["layers"])
    assert image_id(model_image[1], host=worker_dockerd.host) == model_image[1]
    assert worker_dockerd.docker("run", "--rm", model_image[1], "cat", "/model.txt").stdout == "model\n"


def test_a_flipped_pushed_layer_is_refused_removed_and_published_again(
    rank0, worker, worker_dockerd, cache_dir, model_image, model_over_a_published_base
):
    blob = cache_dir / "blobs" / model_over_a_published_base[1]["layers"][-1]["blob"][7:]
    flip_byte(blob, blob.stat().st_size // 2)
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match="does not hash to sha256:.*Publish again from rank 0"):
        load_image(worker, model_image[1], marker_wait=0)

    assert images_on(worker_dockerd) == before and not blob.exists()
    assert publish_image(rank0, model_image[0]).action_taken == "pushed"
    assert load_image(worker, model_image[1]).action_taken == "loaded"


def test_a_flipped_base_layer_in_an_earlier_entry_is_refused_that_entry_removed_and_the_image_published_again(
    rank0, worker, worker_dockerd, cache_dir, busybox_image, model_image, model_over_a_published_base
):
    base_tar = cache_dir / (entry_key(busybox_image[1]) + ".tar")
    first = layer_members(base_tar)[0]
    flip_byte(base_tar, first.offset_data + first.size // 2)
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match=r"does not hash to sha256:.*\(removed\)"):
        load_image(worker, model_image[1], marker_wait=0)

    assert images_on(worker_dockerd) == before
    assert not base_tar.exists() and not base_tar.with_suffix(".json").exists()
    assert publish_image(rank0, model_image[0]).action_taken in ("pushed", "saved")
    assert load_image(worker, model_image[1]).action_taken == "loaded"
    assert image_id(model_image[1], host=worker_dockerd.host) == model_image[1]


def test_a_layered_entry_is_not_loaded_through_a_blobs_dir_that_is_a_symlink(
    worker, cache_dir, tmp_path, model_image, model_over_a_published_base
):
    os.rename(cache_dir / "blobs", tmp_path / "elsewhere")
    (cache_dir / "blobs").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(ImageCacheError, match="blobs is a symbolic link"):
        load_image(worker, model_image[1], marker_wait=0)


def test_two_publishers_of_one_layered_image_at_once_leave_one_entry(
    private_dockerd, worker, worker_dockerd, cache_dir, base_with_a_registry_digest, model_image
):
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    publish_image(CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), base_with_a_registry_digest[0])
    start = threading.Barrier(2)
    results = []

    def publish():
        start.wait()
        results.append(publish_image(CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), model_image[0]))

    threads = [threading.Thread(target=publish) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(result.action_taken for result in results) == ["already-present", "pushed"]
    assert len(os.listdir(cache_dir / "blobs")) == 2  # the model's layer and config, each once, no temp file
    assert load_image(worker, model_image[1]).action_taken == "loaded"


# -- no marker maps a diff ID to another layer's bytes (issue 42, item 1) --------------------------------------


def plant_blob(cache_dir):
    """A blob another local user could have stored through the push target: correctly named by its sha256, the gzip
    of a valid layer tar, but no layer of any image here. Its digest."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("model.txt")
        data = b"forged\n"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = gzip.compress(layer.getvalue())
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    (cache_dir / "blobs").mkdir(mode=0o700, exist_ok=True)
    (cache_dir / "blobs" / digest[7:]).write_bytes(blob)
    return digest


def test_a_forged_manifest_maps_no_layer_to_a_planted_blob(
    rank0, worker, worker_dockerd, cache_dir, base_with_a_registry_digest, model_image, monkeypatch
):
    """A manifest that maps the model's layer to a planted blob (put over the daemon's by a client that got in) is
    checked against the image's config: the blob is another layer, so no marker maps it."""
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    publish_image(rank0, base_with_a_registry_digest[0])
    planted = plant_blob(cache_dir)

    class ForgedManifest(image_cache_publish.PushTarget):
        @property
        def manifest(self):
            if self._manifest is None:
                return None
            forged = json.loads(json.dumps(self._manifest))
            forged["layers"][-1]["digest"] = planted
            return forged

        @manifest.setter
        def manifest(self, value):
            self._manifest = value

    monkeypatch.setattr(image_cache_publish, "PushTarget", ForgedManifest)

    published = publish_image(rank0, model_image[0])

    marker = json.loads((cache_dir / (entry_key(model_image[1]) + ".json")).read_text())
    assert planted not in [layer.get("blob") for layer in marker.get("layers") or []], published.details
    assert load_image(worker, model_image[1], image=model_image[0]).action_taken == "loaded"
    assert worker_dockerd.docker("run", "--rm", model_image[0], "cat", "/model.txt").stdout == "model\n"


def test_a_layer_an_earlier_entrys_marker_lists_but_its_tar_lacks_is_not_mapped_to_that_entry(
    rank0, worker, worker_dockerd, cache_dir, busybox_image, base_with_a_registry_digest, model_image
):
    worker_dockerd.docker("rmi", "-f", model_image[1], check=False)
    publish_image(rank0, base_with_a_registry_digest[0])
    base_marker = cache_dir / (entry_key(busybox_image[1]) + ".json")
    lying = json.loads(base_marker.read_text())
    model_layer = rank0.inspect(model_image[1])["RootFS"]["Layers"][-1]
    lying["diff_ids"].append(model_layer)  # the tar's config does not list it
    base_marker.write_text(json.dumps(lying))

    published = publish_image(rank0, model_image[0])

    marker = json.loads((cache_dir / (entry_key(model_image[1]) + ".json")).read_text())
    mapped = {layer["diff_id"]: layer for layer in marker.get("layers") or []}
    assert "entry" not in mapped.get(model_layer, {}), published.details
    assert load_image(worker, model_image[1]).action_taken == "loaded"
    assert image_id(model_image[1], host=worker_dockerd.host) == model_image[1]


def test_a_marker_that_maps_a_layer_to_another_layers_blob_is_removed_at_load_and_published_anew(
    rank0, worker, worker_dockerd, cache_dir, model_image, model_over_a_published_base
):
    """A marker as a forged manifest made one before its layers were checked (the blob hashes to its name, but is
    another layer than the one the config lists): the load refuses it before docker registers anything, takes the
    marker out, and the next publish writes it anew."""
    marker_path = cache_dir / (entry_key(model_image[1]) + ".json")
    marker = json.loads(marker_path.read_text())
    marker["layers"][-1]["blob"] = plant_blob(cache_dir)
    marker_path.write_text(json.dumps(marker))
    before = images_on(worker_dockerd)

    with pytest.raises(ImageCacheError, match="is not layer sha256:.*the entry removed.*Publish again from rank 0"):
        load_image(worker, model_image[1], marker_wait=0)

    assert images_on(worker_dockerd) == before and not marker_path.exists()
    assert publish_image(rank0, model_image[0]).action_taken == "pushed"
    assert load_image(worker, model_image[1], image=model_image[0]).action_taken == "loaded"
    assert worker_dockerd.docker("run", "--rm", model_image[0], "cat", "/model.txt").stdout == "model\n"


def test_an_entry_whose_marker_names_another_image_is_refused(
    rank0, worker, worker_dockerd, cache_dir, busybox_image, foreign_image
):
    publish_image(rank0, foreign_image[0])
    foreign_key, wanted_key = entry_key(foreign_image[1]), entry_key(busybox_image[1])
    for suffix in (".tar", ".json"):
        os.rename(cache_dir / (foreign_key + suffix), cache_dir / (wanted_key + suffix))

    with pytest.raises(ImageCacheError, match="not the image rank 0 announced"):
        load_image(worker, busybox_image[1], marker_wait=0)

    assert image_id(foreign_image[0], host=worker_dockerd.host) is None


def test_a_missing_marker_is_retried_then_reported(rank0, worker, cache_dir, busybox_image):
    publish_image(rank0, busybox_image[0])
    (cache_dir / (entry_key(busybox_image[1]) + ".json")).unlink()
    started = time.monotonic()

    with pytest.raises(ImageCacheError, match="exists but its commit marker .* does not") as raised:
        load_image(worker, busybox_image[1], marker_wait=0.6)

    assert time.monotonic() - started >= 0.6
    assert "after waiting 0.6 s" in str(raised.value)


def test_a_marker_that_shows_up_late_is_waited_for(rank0, worker, cache_dir, busybox_image):
    publish_image(rank0, busybox_image[0])
    marker = cache_dir / (entry_key(busybox_image[1]) + ".json")
    stash = cache_dir.parent / "stashed-marker"
    os.rename(marker, stash)
    late = threading.Timer(0.5, os.rename, (stash, marker))
    late.start()
    try:
        result = load_image(worker, busybox_image[1], marker_wait=10)
    finally:
        late.join()

    assert (result.action_taken, result.image_id) == ("loaded", busybox_image[1])


def test_an_image_id_that_is_not_a_digest_is_refused(worker):
    with pytest.raises(ImageCacheError, match="not an image ID"):
        load_image(worker, "../../etc/passwd")


# -- rebuild fallback ------------------------------------------------------------------------------------------


@pytest.fixture
def recipe_dir(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy("/bin/busybox", context / "busybox")
    (context / "Dockerfile").write_text(
        'FROM scratch\nCOPY busybox /bin/busybox\nARG PAYLOAD=none\nLABEL payload="${PAYLOAD}"\n'
        'CMD ["/bin/busybox", "true"]\n'
    )
    return context


def recipe_for(context, build_args, fingerprint=None):
    dockerfile = str(context / "Dockerfile")
    return RebuildRecipe(
        dockerfile=dockerfile,
        context=str(context),
        tag=f"slurm-multi-test/rebuilt:{uuid.uuid4().hex[:8]}",
        build_fingerprint=fingerprint or build_fingerprint(dockerfile, build_args, str(context)),
        build_args=build_args,
        log_dir=str(context.parent),
    )


UNPUBLISHED_ID = "sha256:" + "ab" * 32


def test_rebuild_without_an_entry_builds_the_image_with_rank0s_fingerprint(worker, worker_dockerd, recipe_dir):
    recipe = recipe_for(recipe_dir, {"PAYLOAD": "plain"})

    result = load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)

    assert (result.action_taken, result.changed) == ("rebuilt", True)
    labels = json.loads(
        worker_dockerd.docker("image", "inspect", "--format", "{{json .Config.Labels}}", recipe.tag).stdout
    )
    assert labels[FINGERPRINT_LABEL] == recipe.build_fingerprint == result.details["build_fingerprint"]
    assert result.image_id == image_id(recipe.tag, host=worker_dockerd.host)


def test_rebuild_reuses_an_image_that_has_rank0s_fingerprint(worker, recipe_dir):
    recipe = recipe_for(recipe_dir, {"PAYLOAD": "plain"})
    load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)

    result = load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)

    assert (result.action_taken, result.changed) == ("already-present", False)


def test_rebuild_refuses_inputs_whose_fingerprint_differs_from_rank0s(worker, worker_dockerd, recipe_dir):
    recipe = recipe_for(recipe_dir, {"PAYLOAD": "plain"}, fingerprint="0" * 64)

    with pytest.raises(ImageCacheError, match="refusing to rebuild"):
        load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)

    assert image_id(recipe.tag, host=worker_dockerd.host) is None


def test_rebuild_refuses_a_secret_build_arg_saying_how_to_mount_it():
    spec = {
        "dockerfile": "/z/Dockerfile",
        "context": "/z",
        "tag": "t",
        "build_fingerprint": "0" * 64,
        "build_args": {"MAD_SECRETS_PIP": "${MAD_SECRETS_PIP}"},
        "log_dir": "/z/logs",
    }
    with pytest.raises(
        ImageCacheError,
        match=r"rebuild.build_args MAD_SECRETS_PIP is a secret: .*"
        r"RUN --mount=type=secret,id=MAD_SECRETS_PIP",
    ):
        RebuildRecipe.from_dict(spec)


def test_rebuild_without_a_log_dir_is_refused_and_never_logs_to_tmp():
    spec = {"dockerfile": "/z/Dockerfile", "context": "/z", "tag": "t", "build_fingerprint": "0" * 64}
    with pytest.raises(ImageCacheError, match=r"rebuild needs log_dir, the node's dir in the attempt"):
        RebuildRecipe.from_dict(spec)


def test_a_build_arg_with_shell_syntax_reaches_the_build_literally(worker, worker_dockerd, recipe_dir):
    canary = f"/tmp/pwned-{uuid.uuid4().hex}"
    payload = f"x'; touch {canary}; '"
    recipe = recipe_for(recipe_dir, {"PAYLOAD": payload})

    load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe)

    labels = json.loads(
        worker_dockerd.docker("image", "inspect", "--format", "{{json .Config.Labels}}", recipe.tag).stdout
    )
    assert labels["payload"] == payload
    assert not os.path.exists(canary)


# -- check mode ------------------------------------------------------------------------------------------------


def test_publish_in_check_mode_creates_and_saves_nothing(private_dockerd, tmp_path, busybox_image):
    cache_dir = tmp_path / "not-yet"

    result = publish_image(
        CacheDirectory(str(cache_dir), docker_host=private_dockerd.host), busybox_image[0], check_mode=True
    )

    assert (result.action_taken, result.changed) == ("saved", True)
    assert not cache_dir.exists()


def test_load_in_check_mode_loads_nothing(rank0, worker, worker_dockerd, busybox_image):
    publish_image(rank0, busybox_image[0])

    result = load_image(worker, busybox_image[1], check_mode=True)

    assert (result.action_taken, result.changed) == ("loaded", True)
    assert busybox_image[1] not in images_on(worker_dockerd)


def test_rebuild_in_check_mode_builds_nothing(worker, worker_dockerd, recipe_dir):
    recipe = recipe_for(recipe_dir, {"PAYLOAD": "plain"})

    result = load_image(worker, UNPUBLISHED_ID, marker_wait=0, rebuild=recipe, check_mode=True)

    assert (result.action_taken, result.changed) == ("rebuilt", True)
    assert image_id(recipe.tag, host=worker_dockerd.host) is None


# -- prune -----------------------------------------------------------------------------------------------------

DAY = 86400.0


def fake_entry(cache_dir, age_seconds, now, committed=True):
    key = uuid.uuid4().hex * 2
    names = [key + ".tar"] + ([key + ".json"] if committed else [])
    for name in names:
        (cache_dir / name).write_text("{}")
        os.utime(cache_dir / name, (now - age_seconds, now - age_seconds))
    return key


def test_prune_removes_old_entries_beyond_the_newest_ones(cache_dir):
    now = time.time()
    keys = [fake_entry(cache_dir, age * DAY, now) for age in (0, 1, 2, 3)]

    result = prune_entries(CacheDirectory(str(cache_dir)), keep=1, max_age_days=1.5, now=now)

    assert (result.action_taken, result.changed) == ("pruned", True)
    assert entry_files(cache_dir) == sorted(key + suffix for key in keys[:2] for suffix in (".json", ".tar"))


def test_prune_keeps_the_entry_and_blobs_a_layered_entry_that_stays_loads_from(cache_dir):
    now = time.time()
    base, layered, layer, orphan, young = (uuid.uuid4().hex * 2 for _ in range(5))
    marker = {"image_id": "", "size": 0, "sha256": None}
    files = {
        base + ".tar": "", base + ".json": dict(marker, diff_ids=["sha256:" + "1" * 64]),
        layered + ".json": dict(marker, layers=[{"diff_id": "sha256:" + "1" * 64, "entry": base},
                                                {"diff_id": "sha256:" + "2" * 64, "blob": "sha256:" + layer}]),
        "blobs/" + layered: "", "blobs/" + layer: "", "blobs/" + orphan: "", "blobs/" + young: "",
    }  # fmt: skip
    (cache_dir / "blobs").mkdir()
    for name, content in files.items():
        (cache_dir / name).write_text(json.dumps(content) if content else "")
        age = 0 if name in (layered + ".json", "blobs/" + young) else 3 * DAY
        os.utime(cache_dir / name, (now - age, now - age))

    prune_entries(CacheDirectory(str(cache_dir)), keep=1, max_age_days=1, now=now)

    assert entry_files(cache_dir) == sorted([base + ".tar", base + ".json", layered + ".json"])
    assert sorted(os.listdir(cache_dir / "blobs")) == sorted([layered, layer, young])


def test_prune_removes_nothing_through_a_blobs_dir_that_is_a_symlink(cache_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    old = elsewhere / ("0" * 64)
    old.write_text("someone else's file with a blob's name")
    os.utime(old, (time.time() - 30 * DAY,) * 2)
    (cache_dir / "blobs").symlink_to(elsewhere)

    with pytest.raises(ImageCacheError, match="blobs is a symbolic link"):
        prune_entries(CacheDirectory(str(cache_dir)), keep=0, max_age_days=0)

    assert old.exists()


def test_prune_keeps_the_newest_entries_however_old(cache_dir):
    now = time.time()
    keys = [fake_entry(cache_dir, age * DAY, now) for age in (30, 40)]

    result = prune_entries(CacheDirectory(str(cache_dir)), keep=2, max_age_days=1, now=now)

    assert (result.action_taken, result.changed) == ("none", False)
    assert len(entry_files(cache_dir)) == 2 * len(keys)


def test_prune_removes_orphans_older_than_an_hour_and_nothing_being_written(cache_dir):
    now = time.time()
    key = "cd" * 32
    files = {
        f".{key}.node1.4242.0a1b2c3d4e5f.tar.tmp": 2 * 3600,  # its writer died
        f".{key}.node2.4343.0a1b2c3d4e5f.tar.tmp": 60,  # being written
        "notes.txt": 10 * DAY,  # not ours
    }
    for name, age in files.items():
        (cache_dir / name).write_text("x")
        os.utime(cache_dir / name, (now - age, now - age))
    orphan_tar = fake_entry(cache_dir, 2 * 3600, now, committed=False)
    fresh_tar = fake_entry(cache_dir, 60, now, committed=False)

    prune_entries(CacheDirectory(str(cache_dir)), keep=5, max_age_days=7, now=now)

    assert entry_files(cache_dir) == sorted(
        [f".{key}.node2.4343.0a1b2c3d4e5f.tar.tmp", "notes.txt", fresh_tar + ".tar"]
    )
    assert not (cache_dir / (orphan_tar + ".tar")).exists()


def test_prune_in_check_mode_lists_what_it_would_remove_and_removes_nothing(cache_dir):
    now = time.time()
    old = fake_entry(cache_dir, 9 * DAY, now)
    fake_entry(cache_dir, 0, now)

    result = prune_entries(CacheDirectory(str(cache_dir)), keep=1, max_age_days=1, now=now, check_mode=True)

    assert result.changed and result.details["removed"] == [
        str(cache_dir / (old + ".json")),
        str(cache_dir / (old + ".tar")),
    ]
    assert len(entry_files(cache_dir)) == 4


# -- docker_cli, as the cache uses it --------------------------------------------------------------------------


def test_a_failed_docker_call_names_its_command_and_stderr(private_dockerd):
    with pytest.raises(DockerError) as raised:
        run_docker(["image", "rm", "slurm-multi-test/no-such:image"], host=private_dockerd.host)

    assert raised.value.argv[-3:] == ["image", "rm", "slurm-multi-test/no-such:image"]
    assert "no such image" in raised.value.stderr_tail.lower()
    assert "docker --host" in str(raised.value)


def test_a_docker_call_past_its_timeout_is_killed_and_reported(private_dockerd):
    started = time.monotonic()

    with pytest.raises(DockerError, match="timed out after 0.5 s"):
        run_docker(["events"], timeout=0.5, host=private_dockerd.host)

    assert time.monotonic() - started < 5


def test_image_id_of_an_image_the_daemon_lacks_is_none(private_dockerd):
    assert image_id("slurm-multi-test/no-such:image", host=private_dockerd.host) is None
