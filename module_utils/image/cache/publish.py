"""Publishing an image into the cache: only its new layers (a push to a target on rank 0's loopback, push_target.py)
when the cache holds the rest, else the whole `docker save` tar."""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import time

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    DockerStream,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    MARKER_FORMAT,
    CacheDirectory,
    CacheResult,
    ImageCacheError,
    cache_operation,
    entry_key,
    lease,
    publisher_name,
    remove_quietly,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.gzip_layer import blob_hashes
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.layers import (
    entry_diff_ids,
    layer_prefixes,
    layer_sources,
    missing_layer_sources,
    used_files,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PushTarget
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.teach import (
    UnnamedLayer,
    teach_layer_digests,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL

# `docker save` writes about the image's size; the margin covers tar headers and a filesystem's own overhead.
FREE_SPACE_FACTOR = 1.1
FREE_SPACE_SLACK_BYTES = 64 << 20

# Past this share of the image's size (with a floor) a push is stopped and the image saved whole: the push gzips what
# it uploads, which is several times slower than `docker save`.
PUSH_UPLOAD_CAP_FRACTION = 0.05
PUSH_UPLOAD_CAP_FLOOR_BYTES = 64 << 20
# The push after a whole save only asks which layers the daemon names: a cached layer shows in the first 64 KiB of its
# upload, so a few MB suffice, and a large new layer is not gzipped for nothing.
PROBE_UPLOAD_CAP_BYTES = 16 << 20

_ID_REF = re.compile(r"^(?:sha256:)?([0-9a-f]{12,64})$")


@cache_operation
def publish_image(cache: CacheDirectory, image: str, check_mode: bool = False, teach: bool = True) -> CacheResult:
    """Put `image` (a tag or ID on this node's daemon) into the cache as a committed entry, unless it is there whole
    (a damaged one is removed and written anew). `teach`: after a whole save, teach the daemon digests (teach.py)."""
    started = time.monotonic()
    inspected = cache.inspect(image)
    if inspected is None:
        raise ImageCacheError(
            f"image {image!r} is not on this node's Docker daemon: build or load it before publishing"
        )
    image_id = inspected["Id"]
    key = entry_key(image_id)
    tar = cache.tar_path(key)
    exists = cache.open_root(create=not check_mode)
    marker = cache.read_marker(key) if exists else None
    if marker is not None and not missing_layer_sources(cache, key, marker):
        lease(used_files(cache, key, marker))
        return CacheResult("already-present", False, image_id, cache.entry_path(key, marker), marker["size"], started)
    _check_free_space(cache, image, int(inspected.get("Size") or 0))
    if check_mode:
        reason = "the entry is damaged and would be saved anew" if marker else "the cache has no entry for this image"
        return CacheResult("saved", True, image_id, tar, 0, started, reason=reason)
    if marker is not None:
        # Uncommit first: from here on no reader starts on the damaged tar.
        cache.remove(cache.marker_path(key))
        cache.remove(tar)
    id_ref = _ID_REF.match(image.lower())
    tags = [] if id_ref and key.startswith(id_ref.group(1)) else [image]
    fingerprint = ((inspected.get("Config") or {}).get("Labels") or {}).get(FINGERPRINT_LABEL)
    described = {
        "format": MARKER_FORMAT,
        "image_id": image_id,
        "tags": tags,
        "build_fingerprint": fingerprint,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "publisher": publisher_name(),
    }
    not_pushed = _publish_new_layers(cache, inspected, described, started, teach)
    if isinstance(not_pushed, CacheResult):
        return not_pushed
    tar_committed = False
    try:
        size, sha256, tar_committed = _save_tar(cache, image, image_id, key)
        marker_committed = _write_marker(
            cache, key, dict(described, size=size, sha256=sha256, diff_ids=_diff_ids(inspected))
        )
    except OSError as error:
        # The filesystem filled up (or hit a quota) after the free-space check, e.g. another job's writes.
        # No reader uses a tar without its marker, so a tar of ours left without one is only lost space.
        if tar_committed:
            cache.remove(tar)
        fix = ". Free space there (or raise the quota), or remove old entries (state: pruned), and run again"
        raise ImageCacheError(
            f"cannot write the cache entry for {image} in {cache.root}: {error.strerror or error}"
            + (fix if error.errno in (errno.ENOSPC, errno.EDQUOT) else "")
        ) from None
    why = {"not_pushed": not_pushed} if not_pushed else {}
    teachable = not_pushed is None or isinstance(not_pushed, UnnamedLayer)
    if teach and teachable:
        why.update(_teach_if_unnamed(cache, inspected))
    committed = tar_committed or marker_committed
    result = CacheResult("saved" if committed else "already-present", committed, image_id, tar, size, started, **why)
    result.teachable = teachable and not teach
    return result


def _diff_ids(inspected: dict) -> list:
    return [str(diff_id) for diff_id in (inspected.get("RootFS") or {}).get("Layers") or []]


def _publish_new_layers(cache: CacheDirectory, inspected: dict, described: dict, started: float, teach: bool):
    """Publish only the layers the cache lacks, through a push; else why `docker save` must (a str), or None when
    the cache holds none of the image's layers (saved whole, they then serve every later image over them)."""
    image_id = inspected["Id"]
    diff_ids = _diff_ids(inspected)
    sources = layer_sources(cache)
    if not any(diff_id in sources for diff_id in diff_ids):
        return None
    lease(cache.marker_path(sources[d]["entry"]) for d in diff_ids if "entry" in sources.get(d, {}))
    cap = max(PUSH_UPLOAD_CAP_FLOOR_BYTES, int(int(inspected.get("Size") or 0) * PUSH_UPLOAD_CAP_FRACTION))
    stored: dict = {}  # each blob the pushes stored: the diff ID its bytes ungzip to
    claimed = None  # the first push: every digest the daemon names
    prefixes = layer_prefixes(cache, sources, diff_ids)
    taught = False
    pushes = 2  # the second claims only what the cache holds (below)
    while pushes:
        pushes -= 1
        pushed = _push(cache, image_id, cap - _total_size(cache, stored), claimed, prefixes)
        if isinstance(pushed, UnnamedLayer) and teach and not taught:
            # Once per daemon: from then on every push over this base skips it, as a push over a pulled one does.
            not_taught = teach_layer_digests(cache, inspected, sources)
            if not_taught:
                return f"{pushed}, and it could not be taught one: {not_taught}"
            taught = True
            pushes += 1
            continue
        if isinstance(pushed, str):
            return pushed
        manifest, new = pushed
        stored.update(new)
        places = _layer_places(cache, manifest, image_id, diff_ids, sources, stored)
        if places is None or (all(places) and os.path.isfile(cache.blob_path(image_id))):
            break
        # Named by the daemon but lacking here (or another layer's bytes): push again, claiming only what the
        # cache holds.
        claimed = {layer.get("digest") for layer, place in zip(manifest["layers"], places) if place and layer}
    if places is None:
        return "the push's manifest is not the image's"
    if not all(places) or not os.path.isfile(cache.blob_path(image_id)):
        return "the push left a layer that is nowhere in the cache (or only as another layer's bytes)"
    written = _total_size(cache, stored)
    key = entry_key(image_id)
    lease(used_files(cache, key, {"image_id": image_id, "layers": places})[1:])
    committed = _write_marker(cache, key, dict(described, size=written, sha256=None, layers=places))
    return CacheResult(
        "pushed" if committed else "already-present",
        committed,
        image_id,
        cache.marker_path(key),
        written,
        started,
        layers_published=len(set(stored) - {image_id}),
        **({"taught": True} if taught else {}),
    )


@cache_operation
def teach_daemon(cache: CacheDirectory, image: str) -> dict:
    """The lesson publish_image(teach=True) gives after a whole save, for a caller that gives it later (while the
    workers load) to a `teachable` result: {"taught": True}, {"not_taught": why}, or {} when there was none to give."""
    inspected = cache.inspect(image)
    return _teach_if_unnamed(cache, inspected) if inspected else {}


def _teach_if_unnamed(cache: CacheDirectory, inspected: dict) -> dict:
    """After a whole save: teach the daemon digests if a probing push shows it knows a cached layer by none."""
    sources = layer_sources(cache)
    prefixes = layer_prefixes(cache, sources, _diff_ids(inspected))
    unnamed = _push(cache, inspected["Id"], PROBE_UPLOAD_CAP_BYTES, None, prefixes, keep_uploads=False)
    if not isinstance(unnamed, UnnamedLayer):
        return {}
    not_taught = teach_layer_digests(cache, inspected, sources)
    return {"not_taught": not_taught} if not_taught else {"taught": True}


def _push(cache: CacheDirectory, image_id: str, cap: int, claimed, prefixes, keep_uploads: bool = True):
    """(manifest, the diff ID of each blob stored) of one push of `image_id` to a PushTarget, or why it failed."""
    target = PushTarget(cache.blob_dir, image_id, cap, claimed, prefixes, keep_uploads)
    with target, target.docker_config() as env:
        reference = target.reference(image_id.split(":", 1)[1][:12])
        try:
            run_docker(["tag", image_id, reference], timeout=cache.docker_timeout, host=cache.docker_host)
            run_docker(["push", reference], timeout=cache.docker_timeout, host=cache.docker_host, extra_env=env)
        except DockerError as err:
            if target.cached_upload:
                return UnnamedLayer(
                    f"this daemon knows layer {target.cached_upload} by no registry digest (docker load, import)"
                )
            if target.refused:
                return f"the layers built here are over {cap} bytes gzipped"
            return f"the push to this node's loopback failed: {err}"
        finally:
            # The tag and the digest reference the push added: nothing of the target stays on the node.
            run_docker(["image", "rm", "--no-prune", reference], timeout=60, host=cache.docker_host, check=False)
        return target.manifest, dict(target.diff_ids)


def _total_size(cache: CacheDirectory, digests) -> int:
    return sum(os.path.getsize(cache.blob_path(digest)) for digest in digests)


def _layer_places(cache: CacheDirectory, manifest, image_id: str, diff_ids: list, sources: dict, pushed: dict):
    """Where each layer of the pushed image lies (an earlier entry's tar, else a blob), each checked to be the layer of
    its diff ID (None where none is); None when `manifest` is not the pushed image's. So no marker maps a diff ID to
    another layer's bytes, whatever manifest reached the target."""
    if not isinstance(manifest, dict) or (manifest.get("config") or {}).get("digest") != image_id:
        return None
    layers_pushed = manifest.get("layers") or []
    if len(layers_pushed) != len(diff_ids):
        return None
    entry_layers: dict = {}  # entry key: the diff IDs of its config
    places = []
    for diff_id, layer in zip(diff_ids, layers_pushed):
        source = sources.get(diff_id, {})
        if "entry" in source:
            if source["entry"] not in entry_layers:
                entry_layers[source["entry"]] = entry_diff_ids(cache, source["entry"])
            if diff_id in entry_layers[source["entry"]]:
                places.append(dict(source, diff_id=diff_id))
                continue
        # The blob the manifest names, else the one an earlier layered entry maps this diff ID to.
        blobs = [(layer.get("digest"), layer.get("mediaType"))] if isinstance(layer, dict) else []
        if "blob" in source:
            blobs.append((source["blob"], source.get("media_type")))
        verified = (
            {"diff_id": diff_id, "blob": blob, "media_type": media_type}
            for blob, media_type in blobs
            if _blob_is_layer(cache, str(blob), diff_id, pushed)
        )
        places.append(next(verified, None))
    return places


def _blob_is_layer(cache: CacheDirectory, digest: str, diff_id: str, pushed: dict) -> bool:
    """Whether blob `digest` is in the cache and holds layer `diff_id` (see _layer_places)."""
    path = cache.blob_path(digest)
    if not re.match(r"^sha256:[0-9a-f]{64}$", digest) or not os.path.isfile(path):
        return False
    if digest in pushed:
        return pushed[digest] == diff_id
    try:
        hashed, layer = blob_hashes(path)
    except OSError:
        return False
    if hashed != digest:
        remove_quietly(path)  # torn or altered, as a load would remove it
    return hashed == digest and layer == diff_id


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


def _save_tar(cache: CacheDirectory, image: str, image_id: str, key: str):
    """(size, sha256, committed by us) of the entry's tar after `docker save` into it, hashed on the way."""
    temp = cache.temp_path(key, "tar")
    try:
        digest, size = hashlib.sha256(), 0
        with cache.create_file(temp) as out, DockerStream(
            ["save", image], "out", cache.docker_timeout, cache.docker_host
        ) as save:
            for chunk in iter(lambda: save.pipe.read1(CHUNK_BYTES), b""):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
            save.finish()
            out.flush()
            os.fsync(out.fileno())
        # The tag may have moved between inspect and save: then the tar holds another image than its name.
        if cache.image_id_of(image) != image_id:
            raise ImageCacheError(
                f"{image} was retagged while it was being published (it was {image_id}): "
                "publish again once the build that retags it has finished"
            )
        if cache.commit(temp, cache.tar_path(key)):
            return size, digest.hexdigest(), True
    finally:
        cache.remove(temp)
    # Another publisher linked its tar first. A tar only ever gets its final name complete and fsynced, so
    # it is describable as it is; it may differ byte for byte from ours (another daemon's save), hence a hash.
    with cache.open_file(cache.tar_path(key)) as tar:
        digest = hashlib.sha256()
        for chunk in iter(lambda: tar.read(CHUNK_BYTES), b""):
            digest.update(chunk)
        return os.fstat(tar.fileno()).st_size, digest.hexdigest(), False


def _write_marker(cache: CacheDirectory, key: str, marker: dict) -> bool:
    """Commit entry `key`'s marker (the entry exists from then on); True when ours won."""
    temp = cache.temp_path(key, "json")
    with cache.create_file(temp) as out:
        out.write(json.dumps(marker, indent=1, sort_keys=True).encode("utf-8") + b"\n")
        out.flush()
        os.fsync(out.fileno())
    return cache.commit(temp, cache.marker_path(key))
