#!/usr/bin/env python3
"""What the push target's checks cost (issue 42): a layered publish of a model's image over a base the cache holds,
and a worker's load of it, on two private Docker daemons of this script's own.

Each repeat builds a new model image (the base plus a layer of `--layer-mb` MB, half random bytes, half zeros, as a
model's files and a package tree are), publishes the base whole and then the model (pushed: only its layer and
config go, with the push's credential, each upload ungzipped and hashed against its diff ID on the way), and loads
the model on a worker that holds the base (its blob ungzipped and hashed against the diff ID as it is sent).
Reports the median of the `docker push` calls, the whole publish and the load. Needs root (it starts dockerd).

    .venv/bin/python -m benchmarks.image.push_target_bench                  # a 1 MB layer and a 64 MB one, 5 repeats
    .venv/bin/python -m benchmarks.image.push_target_bench --layer-mb 64 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache import publish as image_cache_publish
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PushTarget
from tests.support.dockerd import PrivateDockerd, build_busybox_image

BASE = "slurm-multi-bench/push-base:latest"
MODEL = "slurm-multi-bench/push-model:latest"


def name_the_base_by_a_digest(daemon: PrivateDockerd, base_id: str) -> None:
    """One untimed push of the base, so that the daemon knows its layers by a registry digest (as a pulled base)."""
    with PushTarget(tempfile.mkdtemp() + "/blobs", base_id, 1 << 30) as target, target.docker_config() as env:
        reference = target.reference("base")
        daemon.docker("tag", base_id, reference)
        subprocess.run(["docker", "push", reference], env={**daemon.env, **env}, check=True, capture_output=True)
        daemon.docker("image", "rm", "--no-prune", reference)


def measure(rank0: PrivateDockerd, worker: PrivateDockerd, base_id: str, layer_mb: int, repeat: int) -> dict:
    pushes = []
    real_run_docker = image_cache_publish.run_docker

    def timed(args, **kwargs):
        started = time.monotonic()
        try:
            return real_run_docker(args, **kwargs)
        finally:
            if args[0] == "push":
                pushes.append(time.monotonic() - started)

    image_cache_publish.run_docker = timed
    publishes, loads = [], []
    try:
        for _ in range(repeat):
            context = Path(tempfile.mkdtemp(prefix="push-bench-"))
            half = layer_mb << 19
            (context / "data.bin").write_bytes(os.urandom(half) + bytes(half))
            (context / "Dockerfile").write_text(f"FROM {BASE}\nCOPY data.bin /data.bin\nLABEL n={uuid.uuid4().hex}\n")
            rank0.docker("build", "-q", "-t", MODEL, str(context))
            model_id = rank0.docker("image", "inspect", "--format", "{{.Id}}", MODEL).stdout.strip()
            cache = Path(tempfile.mkdtemp(prefix="push-bench-cache-")) / "cache"
            publisher = CacheDirectory(str(cache), docker_host=rank0.host)
            publish_image(publisher, BASE)
            started = time.monotonic()
            published = publish_image(publisher, MODEL)
            publishes.append(time.monotonic() - started)
            if published.action_taken != "pushed":
                sys.exit(f"the model was not pushed: {published.as_dict()}")
            loader = CacheDirectory(str(cache), docker_host=worker.host)
            load_image(loader, base_id)
            started = time.monotonic()
            load_image(loader, model_id)
            loads.append(time.monotonic() - started)
            worker.docker("rmi", "-f", model_id)
    finally:
        image_cache_publish.run_docker = real_run_docker
    return {
        "docker push": statistics.median(pushes),
        "publish": statistics.median(publishes),
        "load": statistics.median(loads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer-mb", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("this benchmark starts its own dockerd: run it as root")
    rank0 = PrivateDockerd(Path(tempfile.mkdtemp(prefix="push-bench-rank0-"))).start()
    worker = PrivateDockerd(Path(tempfile.mkdtemp(prefix="push-bench-worker-"))).start()
    try:
        base_id = build_busybox_image(rank0, BASE)
        name_the_base_by_a_digest(rank0, base_id)
        for layer_mb in options.layer_mb:
            figures = measure(rank0, worker, base_id, layer_mb, options.repeat)
            shown = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in figures.items())
            print(f"layer {layer_mb} MB, median of {options.repeat}: {shown}")
    finally:
        rank0.stop()
        worker.stop()


if __name__ == "__main__":
    main()
