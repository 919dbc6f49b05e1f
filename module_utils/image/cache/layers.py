"""A worker's load reads only the layers its daemon lacks: the delta of a cache entry, matched by chain ID.

A `docker save` tar (the cache entry) holds the image's config, its manifest and one file per layer. Docker's classic
store (Docker 20.10, and later versions without the containerd image store) loads such a tar without opening the
file of a layer whose chain it already holds: the chain ID names a layer together with every layer under it, and
the daemon keeps the chain IDs of all its layers. So a worker that holds the base (a 15-30 GB `rocm/pytorch` pulled
by an earlier job) loads a model's image from the manifest, the config and the model's own few layers, read from
the entry by offset. Measured on the lab (1 GB PyTorch base on both nodes, a one-file layer on it): a 20 KB delta
loaded in 0.12 s into the same image ID, where the whole entry takes 7 s.

Verified as the whole entry was, layer by layer: the config's sha256 is the image ID rank 0 announced, and every
layer sent hashes to its diff ID in that config. The delta goes to `docker load` with its manifest last, and its
last bytes are held back until every layer matched (HeldBackLoad), so a torn or flipped layer loads nothing.

Where the chains cannot be read this way (the containerd image store of Docker 25+, whose `docker save` writes OCI
layout, or an entry that is no classic `docker save` tar), the caller loads the whole entry.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import tarfile
from typing import Dict, List, Optional, Sequence, Set, Tuple

from ansible.module_utils.docker_cli import run_docker
from ansible.module_utils.image.cache.entries import CHUNK_BYTES, ImageCacheError

MANIFEST = "manifest.json"
# `docker info`'s DriverStatus names the containerd snapshotter when the daemon keeps images in containerd.
CONTAINERD_STORE = "io.containerd.snapshotter"


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
    """Every chain ID this node's daemon holds, or None when its store is not the classic one (see above)."""
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
    """The index of a `docker save` tar: where each of its files lies, its manifest and its config.

    Reading it touches the tar's headers and two small files only: the layers are skipped by seeking.
    """

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

    def layers_lacking(self, held: Set[str]) -> List[Tuple[str, str]]:
        """(file, diff ID) of each layer whose chain `held` lacks: every layer above the first one lacking."""
        chains = chain_ids(self.diff_ids)
        first = next((i for i, chain in enumerate(chains) if chain not in held), len(chains))
        return list(zip(self.layer_files[first:], self.diff_ids[first:]))


def write_delta(saved: SavedImage, lacking: Sequence[Tuple[str, str]], load) -> int:
    """Write the delta tar into `load` (a HeldBackLoad): the config, the lacking layers, the manifest last; returns
    the layer bytes read from the entry. Raises ImageCacheError, having aborted the load, when a layer's bytes do
    not hash to its diff ID."""
    _add_file(load, saved.config_name, saved.config)
    read = 0
    for name, diff_id in lacking:
        member = saved.members.get(name)
        if member is None:
            load.abort()
            raise ImageCacheError(f"it has no file {name} for layer {diff_id}")
        load.feed(_header(name, member.size))
        digest = hashlib.sha256()
        saved.source.seek(member.offset_data)
        left = member.size
        while left:
            chunk = saved.source.read(min(left, CHUNK_BYTES))
            if not chunk:
                load.abort()
                raise ImageCacheError(f"layer file {name} ends {left} bytes early (torn)")
            digest.update(chunk)
            load.feed(chunk)
            left -= len(chunk)
        load.feed(_padding(member.size))
        read += member.size
        if not hmac.compare_digest("sha256:" + digest.hexdigest(), diff_id):
            load.abort()
            raise ImageCacheError(f"layer file {name} does not hash to its diff ID {diff_id} (torn or altered)")
    _add_file(load, MANIFEST, json.dumps([saved.manifest]).encode())
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
