"""Teaching a daemon a registry digest for the layers it holds by none (a base got by `docker load`), so that its
pushes skip them: it pulls a lesson image of those layers from its push target."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import tarfile
from typing import Dict, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    ImageCacheError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.layers import SavedImage
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PushTarget, ServedBlob

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
LAYER_TAR_TYPE = "application/vnd.docker.image.rootfs.diff.tar"
LAYER_GZIP_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"


class UnnamedLayer(str):
    """Why a push was refused: the daemon began to upload a layer the cache holds, knowing it by no digest."""


def lesson(cache: CacheDirectory, inspected: dict, sources: Dict[str, dict], tars) -> tuple:
    """(manifest bytes, blobs by digest) of the lesson for image `inspected`: its bottom layers the cache holds
    (`sources`), under a config of their own. `tars` opens and keeps an entry's SavedImage."""
    diff_ids = [str(d) for d in (inspected.get("RootFS") or {}).get("Layers") or []]
    held = list(itertools.takewhile(lambda diff_id: diff_id in sources, diff_ids))
    config = json.dumps(
        {
            "architecture": inspected.get("Architecture") or "amd64",
            "os": inspected.get("Os") or "linux",
            "rootfs": {"type": "layers", "diff_ids": held},
        }
    ).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    blobs = {config_digest: ServedBlob(data=config)}
    layers = []
    for diff_id in held:
        source = sources[diff_id]
        if "entry" in source:
            part = tars(source["entry"]).part(diff_id)
            blobs[diff_id] = ServedBlob(path=cache.tar_path(source["entry"]), offset=part.offset, size=part.size)
            layers.append({"mediaType": LAYER_TAR_TYPE, "size": part.size, "digest": diff_id})
        else:
            path = cache.blob_path(source["blob"])
            blobs[source["blob"]] = ServedBlob(path=path, size=os.path.getsize(path))
            media_type = source.get("media_type") or LAYER_GZIP_TYPE
            layers.append({"mediaType": media_type, "size": os.path.getsize(path), "digest": source["blob"]})
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "size": len(config), "digest": config_digest},
        "layers": layers,
    }
    return json.dumps(manifest).encode(), blobs


def teach_layer_digests(cache: CacheDirectory, inspected: dict, sources: Dict[str, dict]) -> Optional[str]:
    """Have this node's daemon pull the lesson from a push target: None once it has, else why not."""
    with contextlib.ExitStack() as files:
        opened: Dict[str, SavedImage] = {}

        def tars(key: str) -> SavedImage:
            if key not in opened:
                opened[key] = SavedImage(files.enter_context(cache.open_file(cache.tar_path(key))), "sha256:" + key)
            return opened[key]

        try:
            manifest, blobs = lesson(cache, inspected, sources, tars)
        except (OSError, ValueError, KeyError, tarfile.TarError, ImageCacheError) as err:
            return f"the cache's copy of its layers is unreadable: {err}"
    config_digest = json.loads(manifest)["config"]["digest"]
    with PushTarget(cache.blob_dir, config_digest, 0) as target, target.docker_config() as env:
        target.serve(manifest, blobs)
        reference = target.reference("lesson")
        try:
            run_docker(["pull", "-q", reference], timeout=cache.docker_timeout, host=cache.docker_host, extra_env=env)
        except DockerError as err:
            return f"the pull from this node's loopback failed: {err}"
        finally:
            # The lesson's tag and the image it names (a config alone: its layers are the base's, which stay).
            run_docker(["image", "rm", "--no-prune", reference], timeout=60, host=cache.docker_host, check=False)
    return None
