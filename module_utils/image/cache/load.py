"""Loading a cache entry into this node's daemon: wait for its commit marker, then a verified, one-pass load."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import os
import tarfile
import time
from typing import Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    DockerStream,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache import layers
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    DEFAULT_MARKER_WAIT,
    CacheDirectory,
    CacheResult,
    ImageCacheError,
    cache_operation,
    check_cache_dir,
    entry_key,
    lease,
    remove_quietly,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import (
    RebuildRecipe,
    rebuild_image,
)

# What a load keeps back from `docker load` until the whole tar has matched its marker: the tar's end (its
# index/manifest files and the end-of-archive blocks) plus any padding a tar writer adds.
LOAD_HOLD_BACK_BYTES = 1 << 20


@cache_operation
def load_image(
    cache: CacheDirectory,
    image_id: str,
    image: Optional[str] = None,
    marker_wait: float = DEFAULT_MARKER_WAIT,
    rebuild: Optional[RebuildRecipe] = None,
    check_mode: bool = False,
) -> CacheResult:
    """Make this node's daemon hold image `image_id` (rank 0's, never the cache's word), and `image` point at it: from
    the daemon, else the verified committed entry, else built from `rebuild`."""
    started = time.monotonic()
    key = entry_key(image_id)
    image_id = "sha256:" + key
    if cache.image_id_of(image_id) == image_id:
        if not image or cache.image_id_of(image) == image_id:
            return CacheResult("already-present", False, image_id, None, 0, started)
        if not check_mode:
            run_docker(["tag", image_id, image], timeout=cache.docker_timeout, host=cache.docker_host)
        return CacheResult("tagged", True, image_id, None, 0, started)
    cache.open_root(create=False)
    marker = cache.wait_for_marker(key, marker_wait)
    if marker is None:
        if rebuild is not None:
            return rebuild_image(cache, rebuild, check_mode, started)
        raise ImageCacheError(_missing_entry_message(cache, key, marker_wait))
    tar = cache.entry_path(key, marker)
    if marker["image_id"] != image_id:
        raise ImageCacheError(
            f"entry {tar} is not the image rank 0 announced: its marker names "
            f"{marker['image_id']}, expected {image_id}. Remove {tar} and "
            f"{cache.marker_path(key)}, then publish again from rank 0"
        )
    if check_mode:
        return CacheResult("loaded", True, image_id, tar, int(marker["size"]), started)
    read, layers_loaded = _load_verified(cache, key, marker, image_id)
    if cache.image_id_of(image_id) != image_id:
        raise ImageCacheError(
            f"entry {tar} loaded, but this node's daemon has no image {image_id} afterwards: the tar holds "
            "another image (or this daemon's image store names images differently from rank 0's: the "
            "containerd store and the classic one give different IDs). Check the tags it loaded, remove the "
            "entry and publish again"
        )
    if image and cache.image_id_of(image) != image_id:
        run_docker(["tag", image_id, image], timeout=cache.docker_timeout, host=cache.docker_host)
    return CacheResult("loaded", True, image_id, tar, read, started, layers_loaded=layers_loaded)


def _missing_entry_message(cache: CacheDirectory, key: str, marker_wait: float) -> str:
    """Why a load found no committed entry, and the three ways out."""
    if not os.path.isdir(cache.root):
        where = f"the image cache directory {cache.root} does not exist on this node"
    elif os.path.exists(cache.tar_path(key)):
        where = (
            f"{cache.tar_path(key)} exists but its commit marker {key}.json does not (a publisher still "
            "writing it, or one that died)"
        )
    else:
        where = f"{cache.root} has no entry {key}.tar/.json"
    return (
        f"no committed cache entry for image sha256:{key} after waiting {marker_wait:g} s: {where}. Publish "
        "it from rank 0 first (state: published), raise marker_wait if the shared filesystem shows new "
        "files late, or enable the rebuild fallback"
    )


def _load_verified(cache: CacheDirectory, key: str, marker: dict, image_id: str) -> Tuple[int, Optional[int]]:
    """Load the entry, verified, only the layers this daemon lacks where it can; (bytes read, layers or None)."""
    lease(layers.used_files(cache, key, marker))
    if marker.get("layers"):
        return _load_layered(cache, key, marker, image_id)
    tar = cache.tar_path(key)
    try:
        source = cache.open_file(tar)
    except FileNotFoundError:
        raise ImageCacheError(
            f"entry {tar} is committed (its marker exists) but the tar is gone: remove "
            f"{cache.marker_path(key)} and publish again from rank 0"
        ) from None
    with source:
        delta = _delta_plan(cache, source, int(marker["size"]), image_id)
        if delta is not None:
            saved, parts = delta
            try:
                with HeldBackLoad(cache.docker_timeout, cache.docker_host, hashed=False) as load:
                    read = layers.write_delta(saved.config_name, saved.config, saved.manifest, parts, load)
                    load.finish()
                return read, len(parts)
            except ImageCacheError as err:
                raise ImageCacheError(
                    f"entry {tar} is damaged: {err}. Nothing was loaded. Remove {tar} and "
                    f"{cache.marker_path(key)}, then publish again from rank 0"
                ) from None
            except DockerError:
                pass  # a layer this daemon held went meanwhile (another job's `docker rmi`): load the whole entry
        source.seek(0)
        _load_whole(cache, key, marker, source)
    return int(marker["size"]), None


def _delta_plan(cache: CacheDirectory, source, size: int, image_id: str):
    """(the entry's index, the layers this daemon lacks), or None where the whole entry must be loaded."""
    if os.fstat(source.fileno()).st_size != size:
        return None  # torn or replaced: the whole load names what is wrong with it
    try:
        held = layers.held_chains(cache.docker_host, cache.docker_timeout)
        if held is None:
            return None
        saved = layers.SavedImage(source, image_id)
        return saved, saved.delta_parts(held)
    except (DockerError, ImageCacheError, tarfile.TarError, ValueError, KeyError, OSError):
        return None


def _load_layered(cache: CacheDirectory, key: str, marker: dict, image_id: str) -> Tuple[int, int]:
    """Load a layered entry: the config and the layers this daemon lacks. An altered blob, or an entry mapping a layer
    to another layer's blob, is removed for the next publish to write anew."""
    entry = cache.marker_path(key)
    again = f"Nothing was loaded. Publish again from rank 0 (it re-publishes what {entry} lacks)"
    check_cache_dir(cache.blob_dir, create=False, follow_symlinks=False)
    missing = layers.missing_layer_sources(cache, key, marker)
    if missing:
        raise ImageCacheError(f"entry {entry} lacks {', '.join(missing)} (removed by a prune or by hand). {again}")
    config = _verified_blob(cache, image_id, again)
    diff_ids = [str(layer["diff_id"]) for layer in marker["layers"]]
    try:
        if (json.loads(config).get("rootfs") or {}).get("diff_ids") != diff_ids:
            raise ValueError("its marker's layers are not its config's")
        held = layers.held_chains(cache.docker_host, cache.docker_timeout) or set()
        return _load_layers(cache, key, marker, config, diff_ids, layers.first_lacking(diff_ids, held))
    except layers.MismappedLayer as err:
        # The marker is what is wrong, not the blob (its bytes are its name's): out with the marker, so that no load
        # tries it again and the next publish writes it anew, checked (publish.py).
        cache.remove(entry)
        raise ImageCacheError(f"entry {entry} is damaged: {err} (the entry removed). {again}") from None
    except layers.AlteredLayer as err:
        _remove_damaged(cache, err.part.source.name)
        raise ImageCacheError(f"entry {entry} is damaged: {err} (removed). {again}") from None
    except (ImageCacheError, tarfile.TarError, ValueError) as err:
        raise ImageCacheError(f"entry {entry} is damaged: {err}. {again}") from None
    except DockerError:
        # A layer this daemon held went meanwhile (another job's `docker rmi`): send every layer this time.
        try:
            return _load_layers(cache, key, marker, config, diff_ids, 0)
        except DockerError as err:
            raise ImageCacheError(f"docker load of entry {entry} failed: {err}") from None


def _load_layers(cache, key: str, marker: dict, config: bytes, diff_ids: list, first: int) -> Tuple[int, int]:
    names = [diff_id.split(":", 1)[-1] + "/layer.tar" for diff_id in diff_ids]
    with contextlib.ExitStack() as files:
        tars = {}
        parts = []
        for name, layer in zip(names[first:], marker["layers"][first:]):
            if layer.get("blob"):
                blob = files.enter_context(open(cache.blob_path(layer["blob"]), "rb"))
                size = os.fstat(blob.fileno()).st_size
                parts.append(layers.LayerPart(name, blob, 0, size, layer["blob"], str(layer["diff_id"])))
                continue
            if layer["entry"] not in tars:
                source = files.enter_context(cache.open_file(cache.tar_path(layer["entry"])))
                tars[layer["entry"]] = layers.SavedImage(source, "sha256:" + layer["entry"])
            parts.append(tars[layer["entry"]].part(str(layer["diff_id"]))._replace(name=name))
        # No tags: load_image tags the image it was asked for once the ID is checked.
        manifest = {"Config": key + ".json", "RepoTags": [], "Layers": names}
        with HeldBackLoad(cache.docker_timeout, cache.docker_host, hashed=False) as load:
            read = layers.write_delta(key + ".json", config, manifest, parts, load)
            load.finish()
    return read, len(parts)


def _remove_damaged(cache: CacheDirectory, path: str) -> None:
    """Remove a blob or an entry's tar (its marker first) whose bytes are not what its name says, to be written anew."""
    if os.path.dirname(path) == cache.blob_dir:
        remove_quietly(path)
    elif os.path.dirname(path) == cache.root and path.endswith(".tar"):
        cache.remove(cache.marker_path(os.path.basename(path)[: -len(".tar")]))
        cache.remove(path)


def _verified_blob(cache: CacheDirectory, digest: str, again: str) -> bytes:
    """The blob `digest` (an image config: small), read whole and checked; an altered one is removed."""
    path = cache.blob_path(digest)
    with open(path, "rb") as blob:
        data = blob.read()
    if not hmac.compare_digest("sha256:" + hashlib.sha256(data).hexdigest(), digest):
        remove_quietly(path)
        raise ImageCacheError(f"blob {path} does not hash to {digest} (torn or altered; removed). {again}")
    return data


def _load_whole(cache: CacheDirectory, key: str, marker: dict, source) -> None:
    """Stream the entry's tar into `docker load` once, hashing it; nothing is loaded unless it matches: the tar's end
    stays here until size and sha256 match the marker (undoing a load would let a foreign tar move other jobs' tags)."""
    tar = cache.tar_path(key)
    with HeldBackLoad(cache.docker_timeout, cache.docker_host) as load:
        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
            load.feed(chunk)
        found = load.mismatch(int(marker["size"]), marker["sha256"])
        if found:
            raise ImageCacheError(
                f"entry {tar} is damaged or holds another image: it has {found}, its marker says "
                f"{marker['size']} bytes with sha256 {marker['sha256']}. "
                f"Nothing was loaded. Remove {tar} and {cache.marker_path(key)}, then publish again from rank 0"
            )
        try:
            load.finish()
        except DockerError as err:
            raise ImageCacheError(f"docker load of entry {tar} failed: {err}") from None


class HeldBackLoad:
    """`docker load` fed bytes as they arrive, hashed on the way (unless not `hashed`), its last LOAD_HOLD_BACK_BYTES
    kept back until `finish`: nothing registers unless `mismatch` found none. A context manager: `mismatch`, or leaving
    without `finish`, kills the CLI. A BrokenPipeError ends the writing, not the hashing:
    `finish` reports the CLI's words."""

    def __init__(self, docker_timeout: float, docker_host: Optional[str] = None, hashed: bool = True):
        self._stream = DockerStream(["load"], "in", docker_timeout, docker_host)
        self.digest = hashlib.sha256() if hashed else None
        self.size = 0
        self.broken = False
        self._held = collections.deque()
        self._held_bytes = 0

    def __enter__(self) -> HeldBackLoad:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stream.__exit__(*exc_info)

    def feed(self, chunk: bytes) -> None:
        if self.digest is not None:
            self.digest.update(chunk)
        self.size += len(chunk)
        self._held.append(chunk)
        self._held_bytes += len(chunk)
        while self._held_bytes - len(self._held[0]) >= LOAD_HOLD_BACK_BYTES:
            first = self._held.popleft()
            self._held_bytes -= len(first)
            self._emit(first)

    def mismatch(self, size: int, sha256: str) -> Optional[str]:
        """None when what was fed has `size` bytes and this sha256; else what it has, in words (the load killed)."""
        if self.size == size and hmac.compare_digest(self.digest.hexdigest(), str(sha256)):
            return None
        self.abort()
        return f"{self.size} bytes with sha256 {self.digest.hexdigest()}"

    def abort(self) -> None:
        """Kill docker load before it read the tail: the daemon registers nothing."""
        self._stream.abort()

    def finish(self) -> None:
        """Pass the tail on and wait for docker load; DockerError when it failed."""
        while self._held:
            self._emit(self._held.popleft())
        self._held_bytes = 0
        self._stream.finish()

    def _emit(self, chunk: bytes) -> None:
        if self.broken:
            return
        try:
            self._stream.pipe.write(chunk)
        except BrokenPipeError:
            self.broken = True
