"""A Charliecloud image: one squashfs file in the shared image cache, and each node ready to run it.

    <cache_dir>/<hex>.sqfs    the image, <hex> the sha256 of the file: its identity is sha256:<hex>
    <cache_dir>/<hex>.json    its commit marker, written last (the cache's rules: module_utils/image/cache/entries.py)

A node runs the shared file in place when this user can mount squashfs here (ch-run's SquashFUSE needs /dev/fuse);
else it unpacks it once into node-local storage as a directory image:

    <unpack_dir>/<hex>/       the unpacked tree, made as .<hex>.<node>.<pid>.unpack and renamed into place whole
    <unpack_dir>/<hex>.json   its completion marker, written after the rename: a directory without one is torn

A torn unpack is never run: the next unpack removes it (and any leftover temp whose process is gone)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
import uuid
from typing import Any, Dict, List, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    MARKER_FORMAT,
    CacheDirectory,
    ImageCacheError,
    entry_key,
    lease,
    open_cache_dir,
    publisher_name,
    user_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import LAUNCHER_FILES_DIR
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import WORKSPACE
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import RUN_DIRECTORY
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.commands import (
    CharliecloudError,
    require_command,
)

RUNTIME_NAME = "charliecloud"
SQUASHFS_SUFFIX = ".sqfs"
# Fast: a 1 GB tree in seconds, where gzip (mksquashfs's default) takes a minute (docs/figures.md).
MKSQUASHFS_OPTIONS = ("-comp", "zstd", "-Xcompression-level", "1", "-noappend", "-quiet", "-no-progress")
# The paths ch-run binds the run's directories at (a read-only squashfs has no room to make them at run time, and
# ch-run 0.31 has no --write-fake), made in every tree before mksquashfs: the model dir (madengine's /myworkspace, or
# with MAD's tools its run directory and scripts/common), and the node dir with the launcher's and the tools' files.
MOUNT_POINTS = (WORKSPACE, RUN_DIRECTORY, WORKSPACE + "/scripts/common", LAUNCHER_FILES_DIR)
# ch-run binds the host's /etc/passwd and /etc/group onto these: they must exist in the image.
IDENTITY_FILES = ("etc/passwd", "etc/group")
FUSE_DEVICE = "/dev/fuse"
FUSE_RDEV = os.makedev(10, 229)
UNPACKED_MARKER_SUFFIX = ".json"
_TEMP_UNPACK_SUFFIX = ".unpack"


# --- the tree and the squashfs -------------------------------------------------------------------------------------


def prepare_tree(tree: str, mount_points=()) -> List[str]:
    """Make what ch-run needs in an image tree before it is squashed: the run's mount points (MOUNT_POINTS and
    `mount_points`, absolute container paths) and /etc/passwd, /etc/group. Returns the mount points, for the marker."""
    points = sorted({"/" + str(point).strip("/") for point in list(MOUNT_POINTS) + list(mount_points)})
    for relative in (point.lstrip("/") for point in points):
        if not relative or ".." in relative.split("/"):
            raise CharliecloudError(f"mount point /{relative} is not a plain absolute path inside the image")
        path = os.path.join(tree, relative)
        if not os.path.lexists(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
    os.makedirs(os.path.join(tree, "etc"), exist_ok=True)
    for relative in IDENTITY_FILES:
        path = os.path.join(tree, relative)
        if not os.path.lexists(path):
            with open(path, "a", encoding="utf-8"):
                pass
    return points


def squash_tree(tree: str, output: str, log=None) -> None:
    """`mksquashfs TREE OUTPUT` with MKSQUASHFS_OPTIONS; its output to `log` (binary) when given."""
    argv = [require_command("mksquashfs"), tree, output, *MKSQUASHFS_OPTIONS]
    ran = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    if log is not None:
        log.write(b"# " + " ".join(argv).encode() + b"\n" + ran.stdout + ran.stderr)
        log.flush()
    if ran.returncode != 0:
        raise CharliecloudError(
            f"mksquashfs of {tree} failed (exit {ran.returncode}): {ran.stderr.decode(errors='replace')[-800:]} "
            "(is there room in the image cache?)"
        )


def file_sha256(path: str, handle=None) -> str:
    """The hex sha256 of a file's bytes (read from `handle` when given)."""
    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        source = handle or stack.enter_context(open(path, "rb"))
        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def squashfs_path(cache: CacheDirectory, key: str) -> str:
    return os.path.join(cache.root, key + SQUASHFS_SUFFIX)


def publish_tree(cache: CacheDirectory, tree: str, fingerprint: str, details: Dict[str, Any], log=None):
    """Squash `tree` into the cache as a committed entry: (hex key, marker). The squashfs is written under a temp name
    of this writer's own, hashed, fsynced, committed by link (never replacing a file), its marker last."""
    cache.open_root(create=True)
    temp = cache.temp_path(fingerprint, "sqfs")
    try:
        squash_tree(tree, temp, log)
        with cache.open_file(temp, "rb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            key = file_sha256(temp, handle)
            os.fsync(handle.fileno())
            size = os.fstat(handle.fileno()).st_size
        cache.commit(temp, squashfs_path(cache, key))
    finally:
        cache.remove(temp)
    marker = dict(
        details,
        format=MARKER_FORMAT,
        runtime=RUNTIME_NAME,
        image_id=f"sha256:{key}",
        sha256=key,
        size=size,
        build_fingerprint=fingerprint,
        publisher=publisher_name(),
        created=time.time(),
    )
    if cache.read_marker(key) is None:
        marker_temp = cache.temp_path(key, "json")
        try:
            with cache.create_file(marker_temp) as handle:
                handle.write(json.dumps(marker, sort_keys=True).encode())
                handle.flush()
                os.fsync(handle.fileno())
            cache.commit(marker_temp, cache.marker_path(key))
        finally:
            cache.remove(marker_temp)
    return key, cache.read_marker(key) or marker


def reusable_entry(cache: CacheDirectory, fingerprint: str):
    """(key, marker) of the newest committed squashfs entry built with `fingerprint` whose file is whole; None."""
    if not cache.open_root(create=False):
        return None
    found = []
    for key, marker in cache.committed_markers():
        if marker.get("runtime") != RUNTIME_NAME or marker.get("build_fingerprint") != fingerprint:
            continue
        try:
            size = cache.stat(squashfs_path(cache, key)).st_size
        except FileNotFoundError:
            continue
        if size == marker.get("size"):
            found.append((float(marker.get("created") or 0), key, marker))
    if not found:
        return None
    _, key, marker = max(found)
    lease([squashfs_path(cache, key), cache.marker_path(key)])
    return key, marker


def committed_squashfs(cache: CacheDirectory, image_id: str, marker_wait: float = 0.0) -> str:
    """The path of the committed squashfs entry `image_id` (sha256:<hex>), its marker waited for up to `marker_wait`
    s (network filesystems show files late) and its size checked; refused with the fix when it is not there whole."""
    key = entry_key(image_id)
    marker = cache.wait_for_marker(key, marker_wait)
    path = squashfs_path(cache, key)
    if marker is None or marker.get("runtime") != RUNTIME_NAME:
        raise ImageCacheError(
            f"the image cache {cache.root} has no committed Charliecloud image {image_id} ({key}.json): is "
            "image_cache_dir on storage every node sees? Run the job again to build it"
        )
    try:
        size = cache.stat(path).st_size
    except FileNotFoundError:
        raise ImageCacheError(f"{path} is gone though its marker is there: remove {key}.json and run again") from None
    if size != marker.get("size"):
        raise ImageCacheError(
            f"{path} has {size} bytes, its marker says {marker.get('size')}: a torn or foreign file. Remove "
            f"{key}.sqfs and {key}.json from the cache and run the job again"
        )
    lease([path, cache.marker_path(key)])
    return path


# --- a node ready to run it ----------------------------------------------------------------------------------------


def squashfs_mountable(fuse_device: str = FUSE_DEVICE):
    """(True, why) when this user can mount a squashfs here the way ch-run does (SquashFUSE in its own namespace):
    /dev/fuse is FUSE's device and opens read-write for this user; else (False, why)."""
    try:
        status = os.stat(fuse_device)
    except OSError as err:
        return False, f"{fuse_device} is missing ({err.strerror}): this node has no FUSE"
    if not stat.S_ISCHR(status.st_mode) or status.st_rdev != FUSE_RDEV:
        return False, f"{fuse_device} is not FUSE's device here (hidden or replaced in this mount namespace)"
    try:
        os.close(os.open(fuse_device, os.O_RDWR))
    except OSError as err:
        return False, f"this user cannot open {fuse_device} ({err.strerror})"
    return True, f"{fuse_device} opens for this user: ch-run mounts the squashfs itself"


def resolve_unpack_dir(option: str) -> str:
    """The node-local dir unpacked images go to, its ``%u`` this user's name."""
    return os.path.abspath(os.path.expanduser(user_cache_dir(option)))


def image_identity(path: str) -> Optional[str]:
    """The identity (sha256:<hex>) of a runnable image path: a committed .sqfs (its marker beside it names it), or a
    whole unpacked directory (named <hex>, its completion marker beside it); None for anything else."""
    path = os.path.abspath(str(path)).rstrip("/")
    name = os.path.basename(path)
    key = name[: -len(SQUASHFS_SUFFIX)] if name.endswith(SQUASHFS_SUFFIX) else name
    try:
        key = entry_key(key)
    except ImageCacheError:
        return None
    marker_path = os.path.join(os.path.dirname(path), key + ".json")
    try:
        with open(marker_path, encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("sha256") != key or marker.get("runtime") != RUNTIME_NAME:
        return None
    if name.endswith(SQUASHFS_SUFFIX):
        return f"sha256:{key}" if os.path.isfile(path) else None
    return f"sha256:{key}" if os.path.isdir(path) and marker.get("unpacked") else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(path: str) -> None:
    """Remove an unpacked tree; unsquashfs leaves read-only dirs, which rmtree cannot empty until they are writable."""

    def _writable_then_retry(function, failed, _error):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            os.chmod(failed, 0o700)
        with contextlib.suppress(OSError):
            function(failed)

    shutil.rmtree(path, onerror=_writable_then_retry)


def remove_leftovers(unpack_dir: str) -> list:
    """Remove this node's unpack temps whose process is gone, and unpacked dirs without their completion marker
    (torn); the paths removed."""
    removed = []
    node = publisher_name()
    for name in sorted(os.listdir(unpack_dir)):
        path = os.path.join(unpack_dir, name)
        if name.startswith(".") and name.endswith(_TEMP_UNPACK_SUFFIX):
            parts = name[1 : -len(_TEMP_UNPACK_SUFFIX)].split(".")
            # .<hex>.<node>.<pid>.<random>.unpack: another node's (shared unpack dir) or a live one's is not ours
            if len(parts) >= 4 and parts[-3] == node and parts[-2].isdigit() and not _pid_alive(int(parts[-2])):
                _remove_tree(path)
                removed.append(path)
            continue
        try:
            key = entry_key(name)
        except ImageCacheError:
            continue
        if os.path.isdir(path) and image_identity(path) is None:
            _remove_tree(path)
            removed.append(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + UNPACKED_MARKER_SUFFIX)
        elif key and not os.path.exists(path) and os.path.exists(path + UNPACKED_MARKER_SUFFIX):
            os.unlink(path + UNPACKED_MARKER_SUFFIX)
    return removed


def open_unpack_dir(unpack_dir: str) -> None:
    """Create the unpack dir (0700, parents too) and check it as the cache's dirs are (ours or root's, not writable by
    others: a tree planted there would be run)."""
    descriptor = open_cache_dir(unpack_dir, create=True)
    if descriptor is None:
        raise CharliecloudError(f"cannot create the unpack directory {unpack_dir} (charliecloud_unpack_dir)")
    os.close(descriptor)


def unpack_image(squashfs: str, image_id: str, unpack_dir: str) -> Dict[str, Any]:
    """The unpacked directory image of `squashfs` in `unpack_dir`, made once: an existing whole one is reused, else the
    file is hashed (it must be `image_id`), unsquashed under a temp name and renamed into place whole, then marked
    complete. {reference, action_taken, bytes}."""
    key = entry_key(image_id)
    open_unpack_dir(unpack_dir)
    final = os.path.join(unpack_dir, key)
    removed = remove_leftovers(unpack_dir)
    if image_identity(final) == f"sha256:{key}":
        lease([final, final + UNPACKED_MARKER_SUFFIX])
        return {"reference": final, "action_taken": "already-unpacked", "bytes": 0, "removed": removed}
    found = file_sha256(squashfs)
    if found != key:
        raise ImageCacheError(
            f"{squashfs} hashes to sha256:{found}, not {image_id}: a torn or foreign file in the image cache. "
            "Remove it and its marker, and run the job again"
        )
    temp = os.path.join(unpack_dir, f".{key}.{publisher_name()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.unpack")
    argv = [require_command("unsquashfs"), "-no-progress", "-quiet", "-d", temp, squashfs]
    ran = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    try:
        if ran.returncode != 0:
            raise CharliecloudError(
                f"unsquashfs of {squashfs} into {unpack_dir} failed (exit {ran.returncode}): "
                f"{(ran.stderr or ran.stdout)[-800:]} (is there room in charliecloud_unpack_dir on this node?)"
            )
        try:
            os.rename(temp, final)
        except OSError:
            if image_identity(final) != f"sha256:{key}":
                raise  # not another job's whole unpack of the same image: say what the rename met
        else:
            _write_unpacked_marker(final, key, squashfs)
    finally:
        if os.path.lexists(temp):
            _remove_tree(temp)
    size = os.path.getsize(squashfs)
    return {"reference": final, "action_taken": "unpacked", "bytes": size, "removed": removed}


def _write_unpacked_marker(final: str, key: str, squashfs: str) -> None:
    marker = {"format": MARKER_FORMAT, "runtime": RUNTIME_NAME, "sha256": key, "unpacked": True, "from": squashfs}
    temp = f"{final}.{os.getpid()}.{uuid.uuid4().hex[:8]}.json.tmp"
    with open(temp, "x", encoding="utf-8") as handle:
        json.dump(marker, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(temp, final + UNPACKED_MARKER_SUFFIX)
    safe_files.fsync_directory(os.path.dirname(final))


def make_ready(squashfs: str, image_id: str, unpack_dir: str, mountable: Optional[bool] = None) -> Dict[str, Any]:
    """This node ready to run `image_id`: {reference (the path ch-run is given), image_id, how (in-place, unpacked,
    already-unpacked), why, bytes (read from the cache by this step), seconds}."""
    started = time.monotonic()
    if mountable is None:
        mountable, why = squashfs_mountable()
    else:
        why = "as asked" if mountable else "unpack asked for"
    if mountable:
        result = {"reference": squashfs, "action_taken": "in-place", "bytes": 0}
    else:
        result = unpack_image(squashfs, image_id, resolve_unpack_dir(unpack_dir))
    return dict(
        result, image_id=image_id, how=result["action_taken"], why=why, seconds=round(time.monotonic() - started, 3)
    )
