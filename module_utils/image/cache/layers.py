"""A worker's load reads only the layers its daemon lacks (matched by chain ID), each checked against the announced
IDs (HeldBackLoad); with the containerd store, or an entry that is no classic `docker save` tar, it loads all."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import os
import tarfile
from typing import BinaryIO, Dict, List, NamedTuple, Optional, Sequence, Set

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    ImageCacheError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.gzip_layer import GzipLayerHash
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PREFIX_BYTES

MANIFEST = "manifest.json"
# `docker info`'s DriverStatus names the containerd snapshotter when the daemon keeps images in containerd.
CONTAINERD_STORE = "io.containerd.snapshotter"


class LayerPart(NamedTuple):
    """One layer file of a delta: `size` bytes of `source` from `offset`, which must hash to `digest`, and for a blob
    (gzip) ungzip to `diff_id`, the layer's in the image's config."""

    name: str
    source: BinaryIO
    offset: int
    size: int
    digest: str
    diff_id: Optional[str] = None


def chain_ids(diff_ids: Sequence[str]) -> List[str]:
    """The chain ID of each layer: its diff ID for the first, then sha256 of "<parent chain> <diff ID>"."""
    chains: List[str] = []
    for diff_id in diff_ids:
        if not chains:
            chains.append(diff_id)
        else:
            chains.append("sha256:" + hashlib.sha256(f"{chains[-1]} {diff_id}".encode()).hexdigest())
    return chains


def held_chains(docker_host: Optional[str], timeout: float) -> Optional[Set[str]]:
    """Every chain ID this node's daemon holds, or None when its store is not the classic one."""
    info = run_docker(["info", "--format", "{{json .DriverStatus}}"], timeout=timeout, host=docker_host).stdout
    if CONTAINERD_STORE in info:
        return None
    listed = run_docker(["image", "ls", "-aq", "--no-trunc"], timeout=timeout, host=docker_host).stdout
    ids = sorted(set(listed.split()))
    if not ids:
        return set()
    inspected = run_docker(
        ["image", "inspect", "--format", "{{json .RootFS.Layers}}", *ids], timeout=timeout, host=docker_host
    ).stdout
    held: Set[str] = set()
    for line in inspected.splitlines():
        held.update(chain_ids(json.loads(line) or []))
    return held


class SavedImage:
    """The index of a `docker save` tar (its layers skipped by seeking): where each file lies, manifest, config."""

    def __init__(self, source, image_id: str):
        self.source = source
        self.members: Dict[str, tarfile.TarInfo] = {}
        with tarfile.open(fileobj=source, mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    self.members[member.name] = member
        manifest = json.loads(self.read(MANIFEST))
        if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
            raise ValueError(f"{MANIFEST} does not describe exactly one image")
        self.manifest = manifest[0]
        self.config_name = str(self.manifest.get("Config", ""))
        self.config = self.read(self.config_name)
        if not hmac.compare_digest("sha256:" + hashlib.sha256(self.config).hexdigest(), image_id):
            raise ImageCacheError(f"its config is not the one of image {image_id}")
        self.layer_files = [str(name) for name in self.manifest.get("Layers") or []]
        self.diff_ids = [str(d) for d in (json.loads(self.config).get("rootfs") or {}).get("diff_ids") or []]
        if len(self.layer_files) != len(self.diff_ids):
            raise ImageCacheError(
                f"its manifest names {len(self.layer_files)} layer files and its config {len(self.diff_ids)} layers"
            )

    def read(self, name: str) -> bytes:
        member = self.members.get(name)
        if member is None:
            raise ValueError(f"it has no file {name}")
        self.source.seek(member.offset_data)
        return self.source.read(member.size)

    def delta_parts(self, held: Set[str]) -> List[LayerPart]:
        """The files of the layers whose chain `held` lacks: every layer above the first one lacking."""
        return [self.part(diff_id) for diff_id in self.diff_ids[first_lacking(self.diff_ids, held) :]]

    def part(self, diff_id: str) -> LayerPart:
        """The file of layer `diff_id` inside this tar."""
        name = self.layer_files[self.diff_ids.index(diff_id)]
        member = self.members.get(name)
        if member is None:
            raise ImageCacheError(f"it has no file {name} for layer {diff_id}")
        return LayerPart(name, self.source, member.offset_data, member.size, diff_id)


def first_lacking(diff_ids: Sequence[str], held: Set[str]) -> int:
    """The index of the lowest layer whose chain `held` lacks: it and every layer above it must be loaded."""
    return next((i for i, chain in enumerate(chain_ids(diff_ids)) if chain not in held), len(diff_ids))


def layer_sources(cache) -> Dict[str, dict]:
    """Every layer the cache holds, by diff ID: {"entry": key} inside an entry's tar (preferred: nothing to gunzip),
    else {"blob": digest, "media_type": ...} as a push stored it."""
    entries: Dict[str, dict] = {}
    blobs: Dict[str, dict] = {}
    for key, marker in cache.committed_markers():
        if marker.get("layers"):
            for layer in marker["layers"]:
                if layer.get("blob") and os.path.isfile(cache.blob_path(layer["blob"])):
                    blobs.setdefault(layer["diff_id"], {"blob": layer["blob"], "media_type": layer.get("media_type")})
        elif os.path.isfile(cache.tar_path(key)):
            for diff_id in marker.get("diff_ids") or []:
                entries.setdefault(diff_id, {"entry": key})
    return {**blobs, **entries}


def entry_diff_ids(cache, key: str) -> Set[str]:
    """The diff IDs of the layers in entry `key`'s tar, as its config (hashed against the entry's image ID: the
    marker's list is no proof) lists them; empty when the tar is unreadable or another image's."""
    try:
        with cache.open_file(cache.tar_path(key)) as source:
            return set(SavedImage(source, "sha256:" + key).diff_ids)
    except (OSError, ValueError, KeyError, tarfile.TarError, ImageCacheError):
        return set()


def used_files(cache, key: str, marker: dict) -> List[str]:
    """The files a load of entry `key` reads (to lease them)."""
    if not marker.get("layers"):
        return [cache.marker_path(key), cache.tar_path(key)]
    used = [cache.marker_path(key), cache.blob_path(marker["image_id"])]
    for layer in marker["layers"]:
        used.append(cache.blob_path(layer["blob"]) if layer.get("blob") else cache.marker_path(layer["entry"]))
    return used


def layer_prefixes(cache, sources: Dict[str, dict], diff_ids: Sequence[str]) -> Dict[bytes, str]:
    """The first PREFIX_BYTES of each of `diff_ids` the cache holds (ungzipped), to its diff ID: how the push target
    tells an upload of a cached layer. Shorter or unreadable layers are left out."""
    prefixes: Dict[bytes, str] = {}
    tars: Dict[str, SavedImage] = {}
    for diff_id in diff_ids:
        source = sources.get(diff_id) or {}
        try:
            if source.get("entry"):
                key = source["entry"]
                if key not in tars:
                    tars[key] = SavedImage(cache.open_file(cache.tar_path(key)), "sha256:" + key)
                part = tars[key].part(diff_id)
                part.source.seek(part.offset)
                head = part.source.read(min(part.size, PREFIX_BYTES))
            elif source.get("blob"):
                with gzip.open(cache.blob_path(source["blob"]), "rb") as blob:
                    head = blob.read(PREFIX_BYTES)
            else:
                continue
        except (OSError, EOFError, ValueError, KeyError, tarfile.TarError, ImageCacheError):
            continue
        if len(head) == PREFIX_BYTES:
            prefixes[head] = diff_id
    for saved in tars.values():
        saved.source.close()
    return prefixes


def missing_layer_sources(cache, key: str, marker: dict) -> List[str]:
    """The files entry `key` lacks to be loaded (a tar not of the marker's size counts); empty when whole."""
    if not marker.get("layers"):
        tar = cache.tar_path(key)
        return [] if os.path.isfile(tar) and os.path.getsize(tar) == marker["size"] else [tar]
    needed = [cache.blob_path(marker["image_id"])]
    for layer in marker["layers"]:
        if layer.get("blob"):
            needed.append(cache.blob_path(layer["blob"]))
        else:  # an entry whose marker went (pruned, or found damaged) is no source, even while its tar lingers
            needed += [cache.marker_path(layer["entry"]), cache.tar_path(layer["entry"])]
    return [path for path in needed if not os.path.isfile(path)]


class AlteredLayer(ImageCacheError):
    """A layer file whose bytes are not those its digest names (torn or altered); `part` says which."""

    def __init__(self, message: str, part: LayerPart):
        super().__init__(message)
        self.part = part


class MismappedLayer(AlteredLayer):
    """A blob that is another layer than its entry's marker maps it to: the marker is what is wrong."""


def write_delta(config_name: str, config: bytes, manifest: dict, parts: Sequence[LayerPart], load) -> int:
    """Write the delta tar into `load` (a HeldBackLoad): the config, the layer files `parts`, the manifest last; the
    layer bytes read. AlteredLayer, the load aborted, when a layer is not what its digest names."""
    _add_file(load, config_name, config)
    read = 0
    for part in parts:
        load.feed(_header(part.name, part.size))
        digest = hashlib.sha256()
        layer = GzipLayerHash() if part.diff_id else None
        part.source.seek(part.offset)
        left = part.size
        while left:
            chunk = part.source.read(min(left, CHUNK_BYTES))
            if not chunk:
                load.abort()
                raise AlteredLayer(f"layer file {part.name} ends {left} bytes early (torn)", part)
            digest.update(chunk)
            if layer is not None:
                layer.feed(chunk)
            load.feed(chunk)
            left -= len(chunk)
        load.feed(_padding(part.size))
        read += part.size
        if not hmac.compare_digest("sha256:" + digest.hexdigest(), part.digest):
            load.abort()
            raise AlteredLayer(f"layer file {part.name} does not hash to {part.digest} (torn or altered)", part)
        # Docker would refuse it too, but only after the manifest: this says which blob, and nothing loads.
        if layer is not None and layer.diff_id() != part.diff_id:
            load.abort()
            raise MismappedLayer(
                f"blob {part.digest} is not layer {part.diff_id} of the image's config (it ungzips to "
                f"{layer.diff_id() or 'no single gzip stream'})",
                part,
            )
    _add_file(load, MANIFEST, json.dumps([manifest]).encode())
    load.feed(b"\0" * (2 * tarfile.BLOCKSIZE))  # the end-of-archive blocks
    return read


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def _add_file(load, name: str, data: bytes) -> None:
    load.feed(_header(name, len(data)) + data + _padding(len(data)))
