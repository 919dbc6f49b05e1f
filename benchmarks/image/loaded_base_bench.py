#!/usr/bin/env python3
"""What a publish over a `docker import`ed base costs: the whole save, the first publish that teaches
the daemon a digest for the base (teach.py), and the publishes after it, side by side on one private Docker daemon.

The base is the lab's PyTorch root filesystem tar (1.05 GB, `docker import`ed: the daemon knows it by no registry
digest). Each model image is the base plus a one-file layer that changes between builds. In order: model 1 into an
empty cache (the whole image saved - the base's entry - and the daemon taught); models 2.. (pushed: only their
layer). Beside each, the same image's whole `docker save`: what a publish costs that can neither push nor skip.
Needs root (it starts dockerd) and the lab's base tar (`slurm-multi lab` builds it once).

    .venv/bin/python -m benchmarks.image.loaded_base_bench [--later 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from slurm_multi.lab.pytorch import BASE_TAR
from tests.support.dockerd import PrivateDockerd

BASE = "slurm-multi-bench/imported-base:latest"
MODEL = "slurm-multi-bench/imported-model:latest"


def build_model(daemon: PrivateDockerd) -> None:
    with tempfile.TemporaryDirectory(prefix="loaded-base-bench-context-") as context:
        Path(context, "Dockerfile").write_text(f"FROM {BASE}\nRUN echo {uuid.uuid4().hex} > /model-version\n")
        daemon.docker("build", "--network=host", "-q", "-t", MODEL, context)


def timed_publish(daemon: PrivateDockerd, cache_dir: str):
    """Seconds and result of a publish of MODEL."""
    started = time.monotonic()
    result = publish_image(CacheDirectory(cache_dir, docker_host=daemon.host), MODEL)
    return time.monotonic() - started, result


def timed_whole_save(daemon: PrivateDockerd, tar: Path) -> float:
    """Seconds of `docker save` of MODEL, whole, into `tar`: what a publish costs that can neither push nor skip."""
    started = time.monotonic()
    daemon.docker("save", "-o", str(tar), MODEL)
    seconds = time.monotonic() - started
    tar.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--later", type=int, default=3, help="publishes after the first two (median shown)")
    options = parser.parse_args()
    if os.geteuid() != 0 or not BASE_TAR.is_file():
        sys.exit(f"run as root, with the lab's base tar at {BASE_TAR}")
    with tempfile.TemporaryDirectory(prefix="loaded-base-bench-") as work:
        daemon = PrivateDockerd(Path(work) / "dockerd").start()
        try:
            started = time.monotonic()
            daemon.docker("import", str(BASE_TAR), BASE)
            seconds = time.monotonic() - started
            print(f"docker import of the base ({BASE_TAR.stat().st_size / 1e9:.2f} GB): {seconds:.2f} s")
            rows = []
            for n in range(2 + options.later):
                build_model(daemon)
                seconds, result = timed_publish(daemon, f"{work}/cache")
                whole = timed_whole_save(daemon, Path(work) / "whole.tar")
                rows.append((seconds, whole))
                print(
                    f"model {n + 1}: publish {seconds:.2f} s ({result.action_taken}, {result.bytes} bytes written, "
                    f"{result.details}); the whole save of the same image {whole:.2f} s"
                )
            later = [statistics.median(row[i] for row in rows[2:]) for i in (0, 1)]
            print(f"first publish (whole save, teaching) {rows[0][0]:.2f} s against its whole save {rows[0][1]:.2f} s")
            print(f"second publish {rows[1][0]:.2f} s against {rows[1][1]:.2f} s")
            print(f"later publishes, median: {later[0]:.2f} s against {later[1]:.2f} s")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
