"""The shared image tar cache: rank 0 publishes the image it built, every worker loads it, nobody half-loads it.

Layout of the cache directory (on storage every node sees; NFS and Lustre included):

    <hex>.tar     `docker save` of the image whose ID is `sha256:<hex>`
    <hex>.json    its commit marker: {"format", "image_id", "tags", "size", "sha256", "build_fingerprint",
                  "created", "publisher"}, written last; an entry without its marker does not exist
    .<hex>.<publisher>.<pid>.<random>.{tar,json}.tmp    files being written (removed by `prune` after an hour)

Entries are immutable. A file is written under a temporary name of its writer's own, fsynced, then given its
final name with `link()`, which fails instead of replacing a file already there. So two publishers of one image
race harmlessly, and a reader never has a file replaced under it (on NFS that shows up as ESTALE).

Tars and markers are created 0600 and the directories a publish creates 0700: an image may hold what its
owner would not show other users of the shared filesystem (data baked in by a Dockerfile, a model's files). Every
node runs the job as the same user, so owner-only is all the workers need (they stream the tar into `docker load`).

The image ID a worker must end with comes from rank 0 through the controller, never from the cache: a marker
only describes its tar. IDs are read only through `docker image inspect` (with Docker 25+'s containerd store the
ID is the manifest digest, and `docker save` writes OCI-layout tars), never from inside a tar.
"""

from __future__ import annotations

import collections
import datetime
import errno
import hashlib
import json
import os
import pwd
import re
import socket
import stat
import tempfile
import time
import uuid
from typing import Dict, Optional

from ansible.module_utils.docker_cli import DockerError, DockerStream, image_inspect, run_docker
from ansible.module_utils.image_build import (
    ImageBuildError,
    ImageBuildPlan,
    build_log_name,
    build_secrets_for,
    check_build_args,
    dockerfile_mounts,
    ensure_image,
)
from ansible.module_utils.image_names import FINGERPRINT_LABEL, build_fingerprint

CACHE_DIR_ENV = "MAD_DOCKER_BUILDS"
MARKER_FORMAT = 1
DEFAULT_MARKER_WAIT = 10.0
DEFAULT_DOCKER_TIMEOUT = 3600.0
MARKER_POLL_INTERVAL = 0.25
CHUNK_BYTES = 1 << 20
# What a load keeps back from `docker load` until the whole tar has matched its marker: the tar's end (its
# index/manifest files and the end-of-archive blocks) plus any padding a tar writer adds.
LOAD_HOLD_BACK_BYTES = 1 << 20
# `docker save` writes about the image's size; the margin covers tar headers and a filesystem's own overhead.
FREE_SPACE_FACTOR = 1.1
FREE_SPACE_SLACK_BYTES = 64 << 20
ORPHAN_AGE_SECONDS = 3600.0
# Owner only: see the module docstring.
ENTRY_FILE_MODE = 0o600
CREATED_DIR_MODE = 0o700

_ENTRY_KEY = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_ID_REF = re.compile(r"^(?:sha256:)?([0-9a-f]{12,64})$")
_MARKER_NAME = re.compile(r"^([0-9a-f]{64})\.json$")
_TAR_NAME = re.compile(r"^([0-9a-f]{64})\.tar$")
_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\..+\.(?:tar|json)\.tmp$")
_BUILD_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Filesystems without hard links answer link() with one of these; there the commit falls back to rename().
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


class ImageCacheError(Exception):
    """An expected failure of the image cache, worded for the user: what is wrong and how to fix it."""


class CacheResult:
    """What one publish, load or prune did (or, in check mode, would do)."""

    def __init__(self, action_taken: str, changed: bool, image_id: Optional[str] = None,
                 entry: Optional[str] = None, size: int = 0, started: Optional[float] = None, **details):
        self.action_taken = action_taken
        self.changed = changed
        self.image_id = image_id
        self.entry = entry
        self.bytes = size
        self.seconds = round(time.monotonic() - started, 3) if started is not None else 0.0
        self.details = details

    def as_dict(self) -> dict:
        """The result as the module returns it."""
        result = {"action_taken": self.action_taken, "changed": self.changed, "image_id": self.image_id,
                  "entry": self.entry, "bytes": self.bytes, "seconds": self.seconds}
        result.update(self.details)
        return result


def resolve_cache_dir(option: Optional[str], environ=None) -> str:
    """The cache directory: `MAD_DOCKER_BUILDS` from the node's environment when set, else the `option`."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(CACHE_DIR_ENV) or option
    if not chosen:
        raise ImageCacheError(
            f"no image cache directory: set the cache_dir option (image_cache_dir) or {CACHE_DIR_ENV} to a directory "
            "on storage that every node sees"
        )
    return os.path.abspath(os.path.expanduser(chosen))


def entry_key(image_id: str) -> str:
    """The entry name (the ID's hex digest) of an image ID `sha256:<64 hex>`; anything else is refused."""
    match = _ENTRY_KEY.match(str(image_id).strip().lower())
    if not match:
        raise ImageCacheError(
            f"{image_id!r} is not an image ID: expected sha256:<64 hex digits>, as `docker image inspect "
            "--format '{{.Id}}' IMAGE` prints it on rank 0"
        )
    return match.group(1)


def _owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_cache_dir(path: str, create: bool) -> bool:
    """Make sure `path` is a cache directory only its owner can write; False when it is missing (and not created).

    Refused: not a directory, owned by neither the current user nor root, writable by group or others (a tar
    planted there would be loaded, tags and all, into every node's daemon). Created 0700 (with the parents it
    lacks, 0700 too) when missing and `create`.
    """
    if not os.path.exists(path):
        if not create:
            return False
        try:
            _make_private_dirs(path)
        except OSError as err:
            raise ImageCacheError(f"cannot create the image cache directory {path}: {err.strerror}")
    status = os.stat(path)
    if not stat.S_ISDIR(status.st_mode):
        raise ImageCacheError(f"image cache {path} is not a directory: choose a directory for cache_dir")
    if status.st_uid not in (os.geteuid(), 0):
        raise ImageCacheError(
            f"image cache directory {path} is owned by {_owner_name(status.st_uid)}, not by you "
            f"({_owner_name(os.geteuid())}) or root: use a directory of your own"
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ImageCacheError(
            f"image cache directory {path} is writable by other users (mode {stat.S_IMODE(status.st_mode):04o}): "
            f"a tar planted there would be loaded, with its tags, into every node's Docker daemon. "
            f"Fix: chmod go-w {path}"
        )
    return True


def _make_private_dirs(path: str) -> None:
    """Create `path` and its missing parents, each 0700 (`os.makedirs` gives the parents the umask's mode)."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.exists(parent):
        _make_private_dirs(parent)
    try:
        os.mkdir(path, CREATED_DIR_MODE)
    except FileExistsError:
        pass  # another node's publish created it meanwhile


def _create_private_file(path: str):
    """A new file opened for binary writing, mode 0600 (fails when `path` exists, symlinks included)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ENTRY_FILE_MODE), "wb")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is what readers rely on
    finally:
        os.close(fd)


def _refresh_dir(path: str) -> None:
    # Opening a directory revalidates its attributes on NFS (close-to-open), so a marker created on another node
    # is not hidden by a cached "no such file" lookup.
    os.close(os.open(path, os.O_RDONLY))


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _commit_file(temp: str, final: str) -> bool:
    """Give the complete, fsynced file `temp` the name `final` unless a file has it already; True when ours won.

    Never replaces a file: a committed file may be open on another node. `temp` is gone afterwards either way.
    """
    try:
        try:
            os.link(temp, final)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in _NO_HARD_LINKS:
                raise
            # No hard links here (some FUSE filesystems): check, then rename. Two publishers may both pass the
            # check; the later rename then replaces an identical image's tar, the best such a filesystem allows.
            if os.path.exists(final):
                return False
            os.rename(temp, final)
        _fsync_dir(os.path.dirname(final))
        return True
    finally:
        _remove_quietly(temp)


def _sha256_of_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _publisher_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class RebuildRecipe:
    """How a worker rebuilds the image when the cache has no entry: rank 0's build, checked by fingerprint."""

    def __init__(self, dockerfile: str, context: str, tag: str, build_fingerprint: str,
                 build_args: Optional[Dict[str, str]] = None, log_dir: Optional[str] = None,
                 secrets_file: Optional[str] = None, buildkit_docker_cli: str = "docker"):
        self.dockerfile = dockerfile
        self.context = context
        self.tag = tag
        self.build_fingerprint = build_fingerprint
        self.build_args = dict(build_args or {})
        self.log_dir = log_dir or tempfile.gettempdir()
        self.secrets_file = secrets_file or None
        self.buildkit_docker_cli = buildkit_docker_cli or "docker"

    @classmethod
    def from_dict(cls, data: dict) -> "RebuildRecipe":
        """A recipe from the module's `rebuild` option; missing or malformed fields are refused by name."""
        missing = [key for key in ("dockerfile", "context", "tag", "build_fingerprint") if not data.get(key)]
        if missing:
            raise ImageCacheError(f"rebuild needs {', '.join(missing)} (from rank 0's build manifest)")
        build_args = data.get("build_args") or {}
        if not isinstance(build_args, dict):
            raise ImageCacheError(
                f"rebuild.build_args must be a mapping of NAME: value, not {type(build_args).__name__}"
            )
        for name, value in build_args.items():
            if not _BUILD_ARG_NAME.match(str(name)):
                raise ImageCacheError(
                    f"rebuild.build_args: {name!r} is not a valid build arg name (letters, digits, _)"
                )
            if "\0" in str(value):
                raise ImageCacheError(f"rebuild.build_args: the value of {name} contains a NUL byte")
        try:
            check_build_args(build_args, "rebuild.build_args")
        except ImageBuildError as err:
            raise ImageCacheError(str(err)) from None
        return cls(str(data["dockerfile"]), str(data["context"]), str(data["tag"]), str(data["build_fingerprint"]),
                   {str(name): str(value) for name, value in build_args.items()}, data.get("log_dir"),
                   data.get("secrets_file"), data.get("buildkit_docker_cli") or "docker")

    def build_plan(self) -> ImageBuildPlan:
        """The recipe as the build stage's plan, so the worker builds exactly as rank 0 did.

        Secrets reach the build only as BuildKit secret mounts, from the job's secrets file (image_build).
        """
        mounts = dockerfile_mounts(self.dockerfile)
        try:
            check_build_args(self.build_args, "rebuild.build_args")
            secrets = build_secrets_for(self.dockerfile, mounts, self.secrets_file)
        except ImageBuildError as err:
            raise ImageCacheError(f"cannot rebuild {self.tag}: {err}") from None
        return ImageBuildPlan(
            model={"name": self.tag}, image_name=self.tag, dockerfile=self.dockerfile, context_dir=self.context,
            build_args=self.build_args, build_secrets=secrets, buildkit=bool(mounts),
            fingerprint=self.build_fingerprint,
            log_file=os.path.join(os.path.abspath(self.log_dir), build_log_name(self.tag, self.dockerfile)),
            base_docker=None, gpu_vendor="",
        )


class ImageCache:
    """One cache directory, seen through one Docker daemon (the CLI's default, or `docker_host`)."""

    def __init__(self, root: str, docker_host: Optional[str] = None, docker_timeout: float = DEFAULT_DOCKER_TIMEOUT):
        self.root = os.path.abspath(root)
        self.docker_host = docker_host
        self.docker_timeout = docker_timeout

    def tar_path(self, key: str) -> str:
        """The tar of entry `key` (an image ID's hex digest)."""
        return os.path.join(self.root, key + ".tar")

    def marker_path(self, key: str) -> str:
        """The commit marker of entry `key`."""
        return os.path.join(self.root, key + ".json")

    def _temp_path(self, key: str, kind: str) -> str:
        unique = f"{_publisher_name()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        return os.path.join(self.root, f".{key}.{unique}.{kind}.tmp")

    def _image(self, ref: str) -> Optional[dict]:
        return image_inspect(ref, host=self.docker_host, timeout=self.docker_timeout)

    def _image_id(self, ref: str) -> Optional[str]:
        inspected = self._image(ref)
        return inspected.get("Id") if inspected else None

    def read_marker(self, key: str) -> Optional[dict]:
        """The committed marker of entry `key`, or None when the entry is not committed."""
        path = self.marker_path(key)
        try:
            with open(path, encoding="utf-8") as handle:
                marker = json.load(handle)
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise ImageCacheError(
                f"commit marker {path} is unreadable ({err}): remove it and its .tar, then publish again"
            )
        missing = [field for field in ("image_id", "size", "sha256") if field not in marker]
        if missing:
            raise ImageCacheError(f"commit marker {path} lacks {', '.join(missing)}: remove it and its .tar, "
                                  "then publish again")
        return marker

    def _wait_for_marker(self, key: str, wait: float) -> Optional[dict]:
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            if os.path.isdir(self.root):
                _refresh_dir(self.root)
                marker = self.read_marker(key)
                if marker is not None:
                    return marker
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(MARKER_POLL_INTERVAL, remaining))

    # -- publish ---------------------------------------------------------------------------------------------

    def publish(self, image: str, check_mode: bool = False) -> CacheResult:
        """Save `image` (a tag or ID on this node's daemon) into the cache as a committed entry, unless it is there.

        Skips (unchanged) when the entry is committed and its tar has the marker's size. A committed entry whose
        tar has another size is damaged: it is removed and saved anew.
        """
        started = time.monotonic()
        inspected = self._image(image)
        if inspected is None:
            raise ImageCacheError(f"image {image!r} is not on this node's Docker daemon: build or load it before "
                                  "publishing")
        image_id = inspected["Id"]
        key = entry_key(image_id)
        tar = self.tar_path(key)
        exists = check_cache_dir(self.root, create=not check_mode)
        marker = self.read_marker(key) if exists else None
        if marker is not None and os.path.exists(tar) and os.path.getsize(tar) == marker["size"]:
            return CacheResult("already-present", False, image_id, tar, marker["size"], started)
        self._check_free_space(image, int(inspected.get("Size") or 0))
        if check_mode:
            return CacheResult("saved", True, image_id, tar, 0, started,
                               reason="the entry is damaged and would be saved anew" if marker else
                               "the cache has no entry for this image")
        if marker is not None:
            # Uncommit first: from here on no reader starts on the damaged tar.
            _remove_quietly(self.marker_path(key))
            _remove_quietly(tar)
        id_ref = _ID_REF.match(image.lower())
        tags = [] if id_ref and key.startswith(id_ref.group(1)) else [image]
        fingerprint = ((inspected.get("Config") or {}).get("Labels") or {}).get(FINGERPRINT_LABEL)
        tar_committed = False
        try:
            size, sha256, tar_committed = self._save_tar(image, image_id, key)
            marker_committed = self._write_marker(key, {
                "format": MARKER_FORMAT, "image_id": image_id, "tags": tags, "size": size, "sha256": sha256,
                "build_fingerprint": fingerprint,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "publisher": _publisher_name(),
            })
        except OSError as error:
            # The filesystem filled up (or hit a quota) after the free-space check, e.g. another job's writes.
            # No reader uses a tar without its marker, so a tar of ours left without one is only lost space.
            if tar_committed:
                _remove_quietly(tar)
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            raise ImageCacheError(
                f"cannot write the cache entry for {image} in {self.root}: {error.strerror or error}"
                + (". Free space there (or raise the quota), or remove old entries (state: pruned), and run "
                   "again" if full else "")
            ) from None
        if tar_committed or marker_committed:
            return CacheResult("saved", True, image_id, tar, size, started)
        return CacheResult("already-present", False, image_id, tar, size, started)

    def _check_free_space(self, image: str, image_size: int) -> None:
        probe = self.root
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        filesystem = os.statvfs(probe)
        available = filesystem.f_bavail * filesystem.f_frsize
        needed = int(image_size * FREE_SPACE_FACTOR) + FREE_SPACE_SLACK_BYTES
        if available < needed:
            raise ImageCacheError(
                f"not enough free space in {self.root} to publish {image}: about {needed} bytes needed (image size "
                f"{image_size} x {FREE_SPACE_FACTOR} + {FREE_SPACE_SLACK_BYTES}), {available} available. Free space "
                "there or remove old entries (state: pruned)"
            )

    def _save_tar(self, image: str, image_id: str, key: str):
        """(size, sha256, committed by us) of the entry's tar after `docker save` into it, hashed on the way."""
        temp = self._temp_path(key, "tar")
        try:
            digest, size = hashlib.sha256(), 0
            with _create_private_file(temp) as out, DockerStream(["save", image], "out", self.docker_timeout,
                                                        self.docker_host) as save:
                for chunk in iter(lambda: save.pipe.read1(CHUNK_BYTES), b""):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                save.finish()
                out.flush()
                os.fsync(out.fileno())
            # The tag may have moved between inspect and save: then the tar holds another image than its name.
            if self._image_id(image) != image_id:
                raise ImageCacheError(f"{image} was retagged while it was being published (it was {image_id}): "
                                      "publish again once the build that retags it has finished")
            if _commit_file(temp, self.tar_path(key)):
                return size, digest.hexdigest(), True
        finally:
            _remove_quietly(temp)
        # Another publisher linked its tar first. A tar only ever gets its final name complete and fsynced, so
        # it is describable as it is; it may differ byte for byte from ours (another daemon's save), hence a hash.
        tar = self.tar_path(key)
        return os.path.getsize(tar), _sha256_of_file(tar), False

    def _write_marker(self, key: str, marker: dict) -> bool:
        temp = self._temp_path(key, "json")
        with _create_private_file(temp) as out:
            out.write(json.dumps(marker, indent=1, sort_keys=True).encode("utf-8") + b"\n")
            out.flush()
            os.fsync(out.fileno())
        return _commit_file(temp, self.marker_path(key))

    # -- load ------------------------------------------------------------------------------------------------

    def load(self, image_id: str, image: Optional[str] = None, marker_wait: float = DEFAULT_MARKER_WAIT,
             rebuild: Optional[RebuildRecipe] = None, check_mode: bool = False) -> CacheResult:
        """Make this node's daemon hold image `image_id` (announced by rank 0), and `image` point at it if given.

        Skips when the daemon has the ID already (re-pointing `image` with `docker tag` if needed: "tagged").
        Else loads the committed entry, waiting up to `marker_wait` seconds for its marker to show up, and
        verifies it; with no entry and a `rebuild` recipe, builds the image from the manifest instead.
        """
        started = time.monotonic()
        key = entry_key(image_id)
        image_id = "sha256:" + key
        tar = self.tar_path(key)
        if self._image_id(image_id) == image_id:
            if not image or self._image_id(image) == image_id:
                return CacheResult("already-present", False, image_id, None, 0, started)
            if not check_mode:
                run_docker(["tag", image_id, image], timeout=self.docker_timeout, host=self.docker_host)
            return CacheResult("tagged", True, image_id, None, 0, started)
        if os.path.exists(self.root):
            check_cache_dir(self.root, create=False)
        marker = self._wait_for_marker(key, marker_wait)
        if marker is None:
            if rebuild is not None:
                return self._rebuild(rebuild, check_mode, started)
            raise ImageCacheError(self._missing_entry_message(key, marker_wait))
        if marker["image_id"] != image_id:
            raise ImageCacheError(f"entry {tar} is not the image rank 0 announced: its marker names "
                                  f"{marker['image_id']}, expected {image_id}. Remove {tar} and "
                                  f"{self.marker_path(key)}, then publish again from rank 0")
        if check_mode:
            return CacheResult("loaded", True, image_id, tar, int(marker["size"]), started)
        self._load_verified(key, marker)
        if self._image_id(image_id) != image_id:
            raise ImageCacheError(
                f"entry {tar} loaded, but this node's daemon has no image {image_id} afterwards: the tar holds "
                "another image (or this daemon's image store names images differently from rank 0's: the "
                "containerd store and the classic one give different IDs). Check the tags it loaded, remove the "
                "entry and publish again"
            )
        if image and self._image_id(image) != image_id:
            run_docker(["tag", image_id, image], timeout=self.docker_timeout, host=self.docker_host)
        return CacheResult("loaded", True, image_id, tar, int(marker["size"]), started)

    def _missing_entry_message(self, key: str, marker_wait: float) -> str:
        if not os.path.isdir(self.root):
            where = f"the image cache directory {self.root} does not exist on this node"
        elif os.path.exists(self.tar_path(key)):
            where = (f"{self.tar_path(key)} exists but its commit marker {key}.json does not (a publisher still "
                     "writing it, or one that died)")
        else:
            where = f"{self.root} has no entry {key}.tar/.json"
        return (f"no committed cache entry for image sha256:{key} after waiting {marker_wait:g} s: {where}. Publish "
                "it from rank 0 first (state: published), raise marker_wait if the shared filesystem shows new "
                "files late, or enable the rebuild fallback")

    def _load_verified(self, key: str, marker: dict) -> None:
        """Stream the entry's tar into `docker load` once, hashing it; nothing is loaded unless it matches.

        Why one read is safe: the daemon cannot register an image before it has read the tar's end (its
        manifest and end-of-archive blocks; Docker 20.10 even waits for the end of the upload). So the last
        LOAD_HOLD_BACK_BYTES stay here until size and sha256 match the marker; on a mismatch the CLI is killed,
        the daemon sees an aborted upload and nothing changes on the node. The alternatives are worse: hashing
        first and loading afterwards reads every image twice (over the network on a real cluster); loading
        first and undoing on a mismatch lets a foreign tar move tags that other jobs on the node may be using.
        """
        tar = self.tar_path(key)
        try:
            source = open(tar, "rb")
        except FileNotFoundError:
            raise ImageCacheError(f"entry {tar} is committed (its marker exists) but the tar is gone: remove "
                                  f"{self.marker_path(key)} and publish again from rank 0")
        digest, size = hashlib.sha256(), 0
        held = collections.deque()
        held_bytes = 0
        with source, DockerStream(["load"], "in", self.docker_timeout, self.docker_host) as load:
            try:
                for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
                    digest.update(chunk)
                    size += len(chunk)
                    held.append(chunk)
                    held_bytes += len(chunk)
                    while held_bytes - len(held[0]) >= LOAD_HOLD_BACK_BYTES:
                        first = held.popleft()
                        held_bytes -= len(first)
                        load.pipe.write(first)
                if size != int(marker["size"]) or digest.hexdigest() != marker["sha256"]:
                    load.abort()
                    raise ImageCacheError(
                        f"entry {tar} is damaged or holds another image: it has {size} bytes with sha256 "
                        f"{digest.hexdigest()}, its marker says {marker['size']} bytes with sha256 {marker['sha256']}. "
                        f"Nothing was loaded. Remove {tar} and {self.marker_path(key)}, then publish again from rank 0"
                    )
                for chunk in held:
                    load.pipe.write(chunk)
            except BrokenPipeError:
                pass  # docker load gave up early; finish() raises with its own words
            try:
                load.finish()
            except DockerError as err:
                raise ImageCacheError(f"docker load of entry {tar} failed: {err}")

    # -- rebuild ---------------------------------------------------------------------------------------------

    def _rebuild(self, recipe: RebuildRecipe, check_mode: bool, started: float) -> CacheResult:
        """Build the image from the manifest; it is the right one when its fingerprint label is rank 0's.

        Docker builds are not reproducible, so the image ID differs from rank 0's: what must agree is the
        fingerprint of the inputs (Dockerfile, build args, context), checked here before building.
        """
        for path, what in ((recipe.dockerfile, "Dockerfile"), (recipe.context, "build context")):
            if not os.path.exists(path):
                raise ImageCacheError(f"cannot rebuild {recipe.tag}: the {what} {path} does not exist on this node")
        local = build_fingerprint(recipe.dockerfile, recipe.build_args, recipe.context)
        if local != recipe.build_fingerprint:
            raise ImageCacheError(
                f"refusing to rebuild {recipe.tag}: this node's Dockerfile, build args and context give build "
                f"fingerprint {local}, rank 0 built {recipe.build_fingerprint}. The files differ on this node "
                "(shared storage out of date?): publish the image from rank 0 instead"
            )
        plan = recipe.build_plan()
        env = dict(os.environ, DOCKER_HOST=self.docker_host) if self.docker_host else None
        try:
            outcome = ensure_image(plan, env=env, check_mode=check_mode, buildkit_cli=recipe.buildkit_docker_cli)
        except ImageBuildError as err:
            raise ImageCacheError(f"rebuilding {recipe.tag} failed: {err}")
        if outcome.action == "reused":
            return CacheResult("already-present", False, outcome.image_id, None, 0, started, build_fingerprint=local)
        if outcome.action == "would_build":
            return CacheResult("rebuilt", True, None, None, 0, started, build_fingerprint=local)
        built = self._image(recipe.tag) or {}
        built_fingerprint = ((built.get("Config") or {}).get("Labels") or {}).get(FINGERPRINT_LABEL)
        if built_fingerprint != recipe.build_fingerprint:
            raise ImageCacheError(f"the rebuilt {recipe.tag} carries build fingerprint {built_fingerprint!r}, "
                                  f"expected {recipe.build_fingerprint}")
        return CacheResult("rebuilt", True, built.get("Id"), None, 0, started, build_fingerprint=built_fingerprint,
                           build_log=plan.log_file)

    # -- prune -----------------------------------------------------------------------------------------------

    def prune(self, keep: int, max_age_days: float, check_mode: bool = False,
              now: Optional[float] = None) -> CacheResult:
        """Remove committed entries older than `max_age_days` beyond the newest `keep`, and orphaned files.

        Orphans are temporary files and marker-less tars older than an hour (their writer died). Entries being
        written are younger than that, so they are never touched. A committed entry goes marker first: from
        then on it does not exist for anyone starting to load it.
        """
        started = time.monotonic()
        if keep < 0 or max_age_days < 0:
            raise ImageCacheError("keep and max_age_days must not be negative")
        if not check_cache_dir(self.root, create=False):
            return CacheResult("none", False, started=started, removed=[])
        now = time.time() if now is None else now
        committed, orphans = [], []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            try:
                age = now - os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # removed meanwhile by its writer or another prune
            marker_name = _MARKER_NAME.match(name)
            tar_name = _TAR_NAME.match(name)
            if marker_name:
                committed.append((age, marker_name.group(1)))
            elif age > ORPHAN_AGE_SECONDS and (
                _TEMP_NAME.match(name) or (tar_name and not os.path.exists(self.marker_path(tar_name.group(1))))
            ):
                orphans.append(path)
        committed.sort()
        expired = [key for age, key in committed[keep:] if age > max_age_days * 86400]
        removed = []
        for key in expired:
            removed += [self.marker_path(key), self.tar_path(key)]
        removed += orphans
        if not check_mode:
            for path in removed:
                _remove_quietly(path)
        return CacheResult("pruned" if removed else "none", bool(removed), started=started, removed=removed)
