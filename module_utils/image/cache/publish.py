"""Publishing an image into the cache: `docker save` into a private temporary file, then commit tar and marker.

Rank 0 publishes the image it built; the tar is hashed on the way, and the marker (written last) records its size
and sha256, which every load checks before the daemon may register anything.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import time
from typing import Callable, Optional

from ansible.module_utils.docker_cli import DockerStream
from ansible.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    MARKER_FORMAT,
    CacheDirectory,
    CacheResult,
    ImageCacheError,
    check_cache_dir,
    commit_file,
    create_private_file,
    entry_key,
    publisher_name,
    remove_quietly,
    sha256_of_file,
)
from ansible.module_utils.image.names import FINGERPRINT_LABEL

# `docker save` writes about the image's size; the margin covers tar headers and a filesystem's own overhead.
FREE_SPACE_FACTOR = 1.1
FREE_SPACE_SLACK_BYTES = 64 << 20

_ID_REF = re.compile(r"^(?:sha256:)?([0-9a-f]{12,64})$")


def publish_image(
    cache: CacheDirectory, image: str, check_mode: bool = False, tee: Optional[Callable[[bytes], None]] = None
) -> CacheResult:
    """Save `image` (a tag or ID on this node's daemon) into the cache as a committed entry, unless it is there.

    Skips (unchanged) when the entry is committed and its tar has the marker's size. A committed entry whose
    tar has another size is damaged: it is removed and saved anew.

    `tee` (the streamed transport) is given every chunk of `docker save` as it is written to the cache; the
    result's `streamed` is then (size, sha256) of those bytes, None when nothing was saved.
    """
    started = time.monotonic()
    inspected = cache.inspect(image)
    if inspected is None:
        raise ImageCacheError(
            f"image {image!r} is not on this node's Docker daemon: build or load it before publishing"
        )
    image_id = inspected["Id"]
    key = entry_key(image_id)
    tar = cache.tar_path(key)
    exists = check_cache_dir(cache.root, create=not check_mode)
    marker = cache.read_marker(key) if exists else None
    if marker is not None and os.path.exists(tar) and os.path.getsize(tar) == marker["size"]:
        return CacheResult("already-present", False, image_id, tar, marker["size"], started)
    _check_free_space(cache, image, int(inspected.get("Size") or 0))
    if check_mode:
        return CacheResult(
            "saved",
            True,
            image_id,
            tar,
            0,
            started,
            reason="the entry is damaged and would be saved anew"
            if marker
            else "the cache has no entry for this image",
        )
    if marker is not None:
        # Uncommit first: from here on no reader starts on the damaged tar.
        remove_quietly(cache.marker_path(key))
        remove_quietly(tar)
    id_ref = _ID_REF.match(image.lower())
    tags = [] if id_ref and key.startswith(id_ref.group(1)) else [image]
    fingerprint = ((inspected.get("Config") or {}).get("Labels") or {}).get(FINGERPRINT_LABEL)
    tar_committed = False
    try:
        size, sha256, tar_committed, streamed = _save_tar(cache, image, image_id, key, tee)
        marker_committed = _write_marker(
            cache,
            key,
            {
                "format": MARKER_FORMAT,
                "image_id": image_id,
                "tags": tags,
                "size": size,
                "sha256": sha256,
                "build_fingerprint": fingerprint,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "publisher": publisher_name(),
            },
        )
    except OSError as error:
        # The filesystem filled up (or hit a quota) after the free-space check, e.g. another job's writes.
        # No reader uses a tar without its marker, so a tar of ours left without one is only lost space.
        if tar_committed:
            remove_quietly(tar)
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ImageCacheError(
            f"cannot write the cache entry for {image} in {cache.root}: {error.strerror or error}"
            + (
                ". Free space there (or raise the quota), or remove old entries (state: pruned), and run again"
                if full
                else ""
            )
        ) from None
    if tar_committed or marker_committed:
        result = CacheResult("saved", True, image_id, tar, size, started)
    else:
        result = CacheResult("already-present", False, image_id, tar, size, started)
    result.streamed = streamed
    return result


def _check_free_space(cache: CacheDirectory, image: str, image_size: int) -> None:
    """Refuse to start a save that cannot fit: a full shared filesystem hurts every job that writes there."""
    probe = cache.root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    filesystem = os.statvfs(probe)
    available = filesystem.f_bavail * filesystem.f_frsize
    needed = int(image_size * FREE_SPACE_FACTOR) + FREE_SPACE_SLACK_BYTES
    if available < needed:
        raise ImageCacheError(
            f"not enough free space in {cache.root} to publish {image}: about {needed} bytes needed (image size "
            f"{image_size} x {FREE_SPACE_FACTOR} + {FREE_SPACE_SLACK_BYTES}), {available} available. Free space "
            "there or remove old entries (state: pruned)"
        )


def _save_tar(cache: CacheDirectory, image: str, image_id: str, key: str, tee=None):
    """(size, sha256, committed by us, (size, sha256) of what we saved) of the entry's tar after `docker save` into
    it, hashed on the way; every chunk also goes to `tee` when given."""
    temp = cache.temp_path(key, "tar")
    try:
        digest, size = hashlib.sha256(), 0
        with create_private_file(temp) as out, DockerStream(
            ["save", image], "out", cache.docker_timeout, cache.docker_host
        ) as save:
            for chunk in iter(lambda: save.pipe.read1(CHUNK_BYTES), b""):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
                if tee is not None:
                    tee(chunk)
            save.finish()
            out.flush()
            os.fsync(out.fileno())
        # The tag may have moved between inspect and save: then the tar holds another image than its name.
        if cache.image_id_of(image) != image_id:
            raise ImageCacheError(
                f"{image} was retagged while it was being published (it was {image_id}): "
                "publish again once the build that retags it has finished"
            )
        ours = (size, digest.hexdigest())
        if commit_file(temp, cache.tar_path(key)):
            return size, ours[1], True, ours
    finally:
        remove_quietly(temp)
    # Another publisher linked its tar first. A tar only ever gets its final name complete and fsynced, so
    # it is describable as it is; it may differ byte for byte from ours (another daemon's save), hence a hash.
    tar = cache.tar_path(key)
    return os.path.getsize(tar), sha256_of_file(tar), False, ours


def _write_marker(cache: CacheDirectory, key: str, marker: dict) -> bool:
    """Commit entry `key`'s marker (the entry exists from then on); True when ours won."""
    temp = cache.temp_path(key, "json")
    with create_private_file(temp) as out:
        out.write(json.dumps(marker, indent=1, sort_keys=True).encode("utf-8") + b"\n")
        out.flush()
        os.fsync(out.fileno())
    return commit_file(temp, cache.marker_path(key))
