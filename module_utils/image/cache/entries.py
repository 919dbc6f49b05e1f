"""The shared image tar cache's directory: its entries, their commit markers, the checks and the atomic commit.

    <hex>.tar     `docker save` of the image whose ID is `sha256:<hex>`
    <hex>.sqfs    a Charliecloud image, the squashfs whose sha256 is <hex> (module_utils/runtimes/charliecloud/image.py)
    <hex>.json    its commit marker, written last; a "layered" entry has no tar, its marker lists its layers
    blobs/<hex>   a layer (gzip, as `docker push` sends it) or an image config, named by its sha256
    .<hex>.<publisher>.<pid>.<random>.{tar,json}.tmp    files being written (pruned after an hour)

Entries are immutable: written under a name of the writer's own, fsynced, committed with `link()`, which never
replaces a file (ESTALE on NFS). Files are 0600, dirs 0700, and the directory is used through the descriptor it was
checked by. The image ID a worker must end with comes from rank 0, never from the cache."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pwd
import re
import socket
import stat
import time
import uuid
from typing import Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import image_inspect
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

CACHE_DIR_ENV = "MAD_DOCKER_BUILDS"
MARKER_FORMAT = 1
DEFAULT_MARKER_WAIT = 10.0
DEFAULT_DOCKER_TIMEOUT = 3600.0
MARKER_POLL_INTERVAL = 0.25
CHUNK_BYTES = 1 << 20
ORPHAN_AGE_SECONDS = 3600.0
ENTRY_FILE_MODE = 0o600
CREATED_DIR_MODE = 0o700

_ENTRY_KEY = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_MARKER_NAME = re.compile(r"^([0-9a-f]{64})\.json$")
_ENTRY_FILE_NAME = re.compile(r"^([0-9a-f]{64})\.(?:tar|sqfs)$")
_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\..+\.(?:tar|json|sqfs)\.tmp$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
# Filesystems without hard links answer link() with one of these; there the commit falls back to rename().
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


class ImageCacheError(UserError):
    """An expected failure of the image cache, worded for the user: what is wrong and how to fix it."""


class CacheResult:
    """What one publish, load or prune did (or, in check mode, would do)."""

    def __init__(
        self,
        action_taken: str,
        changed: bool,
        image_id: Optional[str] = None,
        entry: Optional[str] = None,
        size: int = 0,
        started: Optional[float] = None,
        **details,
    ):
        self.action_taken = action_taken
        self.changed = changed
        self.image_id = image_id
        self.entry = entry
        self.bytes = size
        self.seconds = round(time.monotonic() - started, 3) if started is not None else 0.0
        self.details = details
        # A publish whose whole save left the cache holding layers this daemon may name by no digest: worth the
        # daemon's lesson (publish.teach_daemon) when the publish was asked not to teach it; not returned.
        self.teachable = False

    def as_dict(self) -> dict:
        """The result as the module returns it."""
        fields = ("action_taken", "changed", "image_id", "entry", "bytes", "seconds")
        return dict({name: getattr(self, name) for name in fields}, **self.details)


def resolve_cache_dir(option: Optional[str], environ=None) -> str:
    """The cache directory: `MAD_DOCKER_BUILDS` when set, else the `option`, its ``%u`` the user's name."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(CACHE_DIR_ENV) or option
    if not chosen:
        raise ImageCacheError(
            f"no image cache directory: set the cache_dir option (image_cache_dir) or {CACHE_DIR_ENV} to a directory "
            "on storage that every node sees"
        )
    return os.path.abspath(os.path.expanduser(user_cache_dir(chosen)))


def user_cache_dir(path: str) -> str:
    """``path`` with ``%u`` replaced by this process's user name: a default cache dir in /tmp that no other user
    can create first and lock everyone else out of."""
    if "%u" not in path:
        return path
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container): its number names it as well
        user = str(os.geteuid())
    return path.replace("%u", user)


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


def check_cache_dir(path: str, create: bool, follow_symlinks: bool = True) -> bool:
    """`open_cache_dir`'s check, letting the directory go; False when it is missing (and not created)."""
    descriptor = open_cache_dir(path, create, follow_symlinks)
    if descriptor is None:
        return False
    os.close(descriptor)
    return True


def open_cache_dir(path: str, create: bool, follow_symlinks: bool = True) -> Optional[int]:
    """The cache directory `path`, opened and checked by fstat (the caller closes it);
    None when missing and not `create`d.

    Refused: not a directory, owned by neither you nor root, writable by group or others (a planted tar would be
    loaded into every node's daemon), a symlink another user owns, or any link where `follow_symlinks` is False."""
    if not os.path.lexists(path):
        if not create:
            return None
        try:
            _make_private_dirs(path)
        except OSError as err:
            raise ImageCacheError(f"cannot create the image cache directory {path}: {err.strerror}") from None
    try:
        descriptor = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    except NotADirectoryError:
        descriptor = _open_linked_dir(path, follow_symlinks)
    except FileNotFoundError:
        return None  # removed meanwhile (another node's cleanup): as missing
    except OSError as err:
        raise ImageCacheError(f"cannot open the image cache directory {path}: {err.strerror}") from None
    try:
        _check_cache_dir_status(path, os.fstat(descriptor))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _open_linked_dir(path: str, follow_symlinks: bool) -> int:
    """The directory the link `path` names, opened; refused as `open_cache_dir` says."""
    status = os.lstat(path)
    if not stat.S_ISLNK(status.st_mode):
        raise ImageCacheError(f"image cache {path} is not a directory: choose a directory for cache_dir")
    if not follow_symlinks:
        raise ImageCacheError(
            f"image cache directory {path} is a symbolic link, where the cache keeps a directory of its own: remove "
            "the link (the next publish creates the directory)"
        )
    if status.st_uid not in (os.geteuid(), 0):
        raise ImageCacheError(
            f"image cache directory {path} is a symbolic link owned by {_owner_name(status.st_uid)}, not by you "
            f"({_owner_name(os.geteuid())}) or root: it may have been planted to redirect the cache. Remove it, or "
            "choose a cache_dir of your own"
        )
    try:
        return os.open(path, _DIR_FLAGS)
    except NotADirectoryError:
        raise ImageCacheError(f"image cache {path} is not a directory: choose a directory for cache_dir") from None
    except OSError as err:
        raise ImageCacheError(f"cannot open the image cache directory {path}: {err.strerror}") from None


def _check_cache_dir_status(path: str, status: os.stat_result) -> None:
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


def _make_private_dirs(path: str) -> None:
    """Create `path` and its missing parents, each 0700 (`os.makedirs` gives the parents the umask's mode)."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.exists(parent):
        _make_private_dirs(parent)
    with contextlib.suppress(FileExistsError):  # another node's publish created it meanwhile
        os.mkdir(path, CREATED_DIR_MODE)


def create_private_file(path: str, dir_fd: Optional[int] = None):
    """A new file (0600, relative to `dir_fd` when given) opened for binary writing; fails when `path` exists."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ENTRY_FILE_MODE, dir_fd=dir_fd), "wb")


def lease(paths) -> None:
    """Mark the files a publish or load uses as in use (mtime now), which prune's age rules count from; a timestamp
    works on NFS, where locks may not."""
    for path in paths:
        # One gone meanwhile (the load then names it), or another user's: its age rule still holds.
        with contextlib.suppress(OSError):
            os.utime(path)


def remove_quietly(path: str, dir_fd: Optional[int] = None) -> None:
    """Remove the file `path` (relative to `dir_fd` when given) if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)


def commit_file(temp: str, final: str, dir_fd: Optional[int] = None) -> bool:
    """Give the complete, fsynced file `temp` the name `final` (both relative to `dir_fd` when given) unless a file
    has it already, which may be open on another node; True when ours won. `temp` is gone afterwards either way."""
    at = {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    try:
        try:
            os.link(temp, final, **at)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in _NO_HARD_LINKS:
                raise
            # No hard links here (some FUSE filesystems): check, then rename. Two publishers may both pass the
            # check; the later rename then replaces an identical image's tar, the best such a filesystem allows.
            if _exists(final, dir_fd):
                return False
            os.rename(temp, final, **at)
        if dir_fd is None:
            safe_files.fsync_directory(os.path.dirname(final))
        else:
            # Some filesystems refuse fsync on a directory (EINVAL): the file itself is on disk.
            with contextlib.suppress(OSError):
                os.fsync(dir_fd)
        return True
    finally:
        remove_quietly(temp, dir_fd)


def _exists(path: str, dir_fd: Optional[int] = None) -> bool:
    """Whether `path` (relative to `dir_fd` when given) is there; a link counts."""
    try:
        os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def publisher_name() -> str:
    """This node's name as markers and temporary files record it (SLURM's node name, else the hostname)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class CacheDirectory:
    """One cache directory, seen through one Docker daemon (the CLI's default, or `docker_host`)."""

    _root_fd: Optional[int] = None

    def __init__(self, root: str, docker_host: Optional[str] = None, docker_timeout: float = DEFAULT_DOCKER_TIMEOUT):
        self.root = os.path.abspath(root)
        self.docker_host = docker_host
        self.docker_timeout = docker_timeout

    def open_root(self, create: bool = False) -> bool:
        """Check the cache directory (`open_cache_dir`) and hold it open; False when it is missing (not created)."""
        if self._root_fd is None:
            self._root_fd = open_cache_dir(self.root, create)
        return self._root_fd is not None

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def __del__(self):
        self.close()

    def _at(self, path: str):
        """(name, the root's descriptor) for a file directly in the (checked) root, else (path, None)."""
        if os.path.dirname(path) != self.root or not self.open_root(create=False):
            return path, None
        return os.path.basename(path), self._root_fd

    def open_file(self, path: str, mode: str = "rb"):
        """The cache's file `path` opened for reading, through the root's descriptor."""
        name, dir_fd = self._at(path)
        return open(path, mode, opener=lambda _path, flags: os.open(name, flags, dir_fd=dir_fd))

    def create_file(self, path: str):
        return create_private_file(*self._at(path))

    def commit(self, temp: str, final: str) -> bool:
        name, dir_fd = self._at(final)
        return commit_file(os.path.basename(temp) if dir_fd is not None else temp, name, dir_fd)

    def remove(self, path: str) -> None:
        remove_quietly(*self._at(path))

    def stat(self, path: str) -> os.stat_result:
        """The status of the cache's file `path`, a link not followed."""
        name, dir_fd = self._at(path)
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)

    def has(self, path: str) -> bool:
        return _exists(*self._at(path))

    def names(self) -> list:
        try:
            return os.listdir(self._root_fd if self.open_root(create=False) else self.root)
        except FileNotFoundError:
            return []

    def tar_path(self, key: str) -> str:
        return os.path.join(self.root, key + ".tar")

    def squashfs_path(self, key: str) -> str:
        return os.path.join(self.root, key + ".sqfs")

    @property
    def blob_dir(self) -> str:
        return os.path.join(self.root, "blobs")

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blob_dir, digest.split(":", 1)[-1])

    def entry_path(self, key: str, marker: dict) -> str:
        """What names entry `key` to a user: its tar, or the marker of a layered entry."""
        return self.marker_path(key) if marker.get("layers") else self.tar_path(key)

    def marker_path(self, key: str) -> str:
        return os.path.join(self.root, key + ".json")

    def temp_path(self, key: str, kind: str) -> str:
        """A temporary file name for entry `key`'s `kind` (tar, json) of this writer's own."""
        unique = f"{publisher_name()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        return os.path.join(self.root, f".{key}.{unique}.{kind}.tmp")

    def inspect(self, ref: str) -> Optional[dict]:
        """`docker image inspect` of `ref` on this cache's daemon, or None when the daemon has no such image."""
        return image_inspect(ref, host=self.docker_host, timeout=self.docker_timeout)

    def image_id_of(self, ref: str) -> Optional[str]:
        inspected = self.inspect(ref)
        return inspected.get("Id") if inspected else None

    def read_marker(self, key: str) -> Optional[dict]:
        """The committed marker of entry `key`, or None when the entry is not committed."""
        path = self.marker_path(key)
        try:
            with self.open_file(path, "r") as handle:
                marker = json.load(handle)
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise ImageCacheError(
                f"commit marker {path} is unreadable ({err}): remove it and its .tar, then publish again"
            ) from None
        missing = [field for field in ("image_id", "size", "sha256") if field not in marker]
        if missing:
            raise ImageCacheError(
                f"commit marker {path} lacks {', '.join(missing)}: remove it and its .tar, then publish again"
            )
        return marker

    def committed_markers(self):
        """(key, marker) of every committed entry whose marker reads."""
        for name in sorted(self.names()):
            committed = _MARKER_NAME.match(name)
            if committed:
                try:
                    marker = self.read_marker(committed.group(1))
                except ImageCacheError:
                    continue
                if marker is not None:
                    yield committed.group(1), marker

    def wait_for_marker(self, key: str, wait: float) -> Optional[dict]:
        """Entry `key`'s committed marker, polled for up to `wait` seconds; None when it did not show up."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            if self.open_root(create=False):
                # Opening the dir revalidates it on NFS (close-to-open): a marker another node made shows up here.
                with contextlib.suppress(OSError):  # gone or not ours: the marker's own lookup says what is there
                    os.close(os.open(self.root, os.O_RDONLY))
                marker = self.read_marker(key)
                if marker is not None:
                    return marker
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(MARKER_POLL_INTERVAL, remaining))


def cache_operation(operation):
    """Decorates `operation(cache, ...)` to let the cache directory it opens go when it ends."""

    @functools.wraps(operation)
    def run(cache: CacheDirectory, *args, **kwargs):
        try:
            return operation(cache, *args, **kwargs)
        finally:
            cache.close()

    return run


@cache_operation
def prune_entries(
    cache: CacheDirectory, keep: int, max_age_days: float, check_mode: bool = False, now: Optional[float] = None
) -> CacheResult:
    """Remove committed entries older than `max_age_days` beyond the newest `keep`, and orphans older than an hour.

    A committed entry goes marker first, so no load starts on it after; an expired entry stays while a staying entry has
    layers in it. Ages count from the last `lease`."""
    started = time.monotonic()
    if keep < 0 or max_age_days < 0:
        raise ImageCacheError("keep and max_age_days must not be negative")
    if not cache.open_root(create=False):
        return CacheResult("none", False, started=started, removed=[])
    now = time.time() if now is None else now
    committed, orphans = [], []
    for name in cache.names():
        path = os.path.join(cache.root, name)
        try:
            age = now - cache.stat(path).st_mtime
        except FileNotFoundError:
            continue  # removed meanwhile by its writer or another prune
        marker_name = _MARKER_NAME.match(name)
        entry_file = _ENTRY_FILE_NAME.match(name)
        if marker_name:
            committed.append((age, marker_name.group(1)))
        elif age > ORPHAN_AGE_SECONDS and (
            _TEMP_NAME.match(name) or (entry_file and not cache.has(cache.marker_path(entry_file.group(1))))
        ):
            orphans.append(path)
    committed.sort()
    expired = {key for age, key in committed[keep:] if age > max_age_days * 86400}
    # What the entries that stay still load from: the entries their layers lie in (which stay too: layered entries
    # name only tar entries), their configs' and layers' blobs.
    needed_entries, needed_blobs = set(), set()
    markers = dict(cache.committed_markers())
    for _, key in committed:
        marker = None if key in expired else markers.get(key)
        for layer in (marker or {}).get("layers") or []:
            needed_entries.add(layer.get("entry"))
            needed_blobs.add(str(layer.get("blob")).split(":")[-1])
        if marker and marker.get("layers"):
            needed_blobs.add(key)
    removed = []
    for key in sorted(expired - needed_entries):
        removed += [cache.marker_path(key), cache.tar_path(key)]
        if cache.has(cache.squashfs_path(key)):
            removed.append(cache.squashfs_path(key))
    if check_cache_dir(cache.blob_dir, create=False, follow_symlinks=False):
        for name in sorted(os.listdir(cache.blob_dir)):
            path = os.path.join(cache.blob_dir, name)
            try:
                age = now - os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            # A blob younger than an hour may belong to a publish still under way (its marker not yet written).
            if name not in needed_blobs and age > ORPHAN_AGE_SECONDS:
                removed.append(path)
    removed += orphans
    if not check_mode:
        for path in removed:
            cache.remove(path)
    return CacheResult("pruned" if removed else "none", bool(removed), started=started, removed=removed)
