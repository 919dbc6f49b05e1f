#!/usr/bin/env python3
"""What a one-file rebuild over the lab's 1.05 GB PyTorch base costs under Charliecloud, until every node is ready,
and the options measured side by side in one run (docs/figures.md, "Charliecloud: the thin rebuild").

Each model image is the base plus one file that changes between builds (`RUN echo <new> > /model-version`). In turns:

* slurm-multi's path (module_utils/runtimes/charliecloud/build.py): the base imported once into ch-image's storage
  and kept; each rebuild is `ch-image build` (its build cache where git is installed: only what changed over the
  base is checked out), mksquashfs
  (zstd level 1) straight into the cache, hashed, committed; then 3 nodes made ready: in place (nothing to copy)
  or, the FUSE-less fallback, 3 unsquashfs at once (node-local unpack);
* the base imported again for each build (what a build from scratch pays);
* mksquashfs's compressors on the same tree (zstd 1, lz4, gzip: mksquashfs's and ch-convert's default);
* mksquashfs's append mode: the base's squashfs copied, the model's new files appended (what it costs; its merge
  renames a colliding directory rather than merging into it, so it fits only files at new top-level paths);
* ch-image's build cache alone, with no squashfs (`--cache`, a git repository in its storage): the first build and a
  rebuild.

Needs the lab's base tar (`slurm-multi lab pytorch-base`), ch-image and squashfs-tools; runs as any user.

    .venv/bin/python -m benchmarks.image.charliecloud_rebuild_bench [--rebuilds 3] [--skip-cache]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import plan_image_builds
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.build import (
    CharliecloudBuild,
    ensure_image,
    image_tree,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.commands import (
    ch_environment,
    ch_image_argv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import make_ready
from slurm_multi.lab.pytorch import BASE_TAR

BASE = "slurm-multi-bench/pytorch-base:latest"
NODES = 3
DOCKERFILE = "ARG BASE_DOCKER\nFROM $BASE_DOCKER\nRUN echo {version} > /model-version\n"


def timed(function, *args, **kwargs):
    started = time.monotonic()
    result = function(*args, **kwargs)
    return time.monotonic() - started, result


def run(argv, env=None) -> None:
    subprocess.run(argv, env=env, check=True, stdin=subprocess.DEVNULL, capture_output=True)


class Zoo:
    """A one-card model zoo whose Dockerfile changes one file per build."""

    def __init__(self, root: Path):
        self.root = root
        (root / "docker").mkdir(parents=True)
        self.card = {"name": "bench", "dockerfile": "docker/bench", "tags": ["bench"], "args": ""}

    def plan(self, log_dir: Path):
        (self.root / "docker" / "bench.Dockerfile").write_text(DOCKERFILE.format(version=uuid.uuid4().hex))
        context = {"docker_build_arg": {"BASE_DOCKER": BASE}, "gpu_vendor": "AMD", "guest_os": "UBUNTU"}
        return plan_image_builds(str(self.root), [self.card], context, str(log_dir))[0]


def ready_in_place(squashfs: str, image_id: str, unpack_dir: str) -> float:
    with ThreadPoolExecutor(NODES) as pool:
        started = time.monotonic()
        list(pool.map(lambda _: make_ready(squashfs, image_id, unpack_dir, mountable=True), range(NODES)))
        return time.monotonic() - started


def ready_unpacked(squashfs: str, image_id: str, work: Path) -> float:
    """3 nodes' unpack at once, each into its own node-local dir."""
    dirs = [str(work / f"unpack-node{rank}") for rank in range(NODES)]
    with ThreadPoolExecutor(NODES) as pool:
        started = time.monotonic()
        list(pool.map(lambda path: make_ready(squashfs, image_id, path, mountable=False), dirs))
        seconds = time.monotonic() - started
    for path in dirs:
        subprocess.run(["rm", "-rf", path], check=False)
    return seconds


def squash_variants(tree: str, work: Path) -> dict:
    """{label: (seconds, bytes)} of mksquashfs with each compressor on `tree`."""
    variants = {
        "zstd -Xcompression-level 1": ["-comp", "zstd", "-Xcompression-level", "1"],
        "lz4": ["-comp", "lz4"],
        "gzip (default)": [],
    }
    found = {}
    for label, options in variants.items():
        output = work / "variant.sqfs"
        seconds, _ = timed(run, ["mksquashfs", tree, str(output), "-noappend", "-quiet", "-no-progress", *options])
        found[label] = (seconds, output.stat().st_size)
        output.unlink()
    return found


def append_variant(base_tree: str, work: Path) -> tuple:
    """(copy s, append s): the base's squashfs copied, then a one-file dir appended to the copy."""
    base_sqfs = work / "base.sqfs"
    run(["mksquashfs", base_tree, str(base_sqfs), "-comp", "zstd", "-Xcompression-level", "1", "-noappend", "-quiet"])
    layer = work / "layer"
    layer.mkdir()
    (layer / "model-version").write_text(uuid.uuid4().hex)
    copy = work / "appended.sqfs"
    copy_s, _ = timed(shutil.copyfile, base_sqfs, copy)
    append_s, _ = timed(run, ["mksquashfs", str(layer), str(copy), "-quiet", "-no-progress"])
    for path in (base_sqfs, copy):
        path.unlink()
    return copy_s, append_s


def cache_variant(zoo: Zoo, work: Path, rebuilds: int) -> tuple:
    """(first build s, median rebuild s) with ch-image's build cache on, in a storage of its own."""
    env = dict(ch_environment(str(work / "cached-storage")), CH_IMAGE_CACHE="enabled")
    env.update(GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost")
    env.update(GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@localhost")
    import_s, _ = timed(run, ch_image_argv(["import", str(BASE_TAR), BASE]), env)
    times = []
    for _ in range(rebuilds + 1):
        plan = zoo.plan(work)
        argv = ch_image_argv(
            ["build", "-t", "cached-model", "-f", plan.dockerfile, "--build-arg", f"BASE_DOCKER={BASE}"]
        )
        seconds, _ = timed(run, argv + [plan.context_dir], env)
        times.append(seconds)
    return import_s, times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuilds", type=int, default=3, help="one-file rebuilds after the first build (median)")
    parser.add_argument("--skip-cache", action="store_true", help="leave out ch-image's build cache variant")
    options = parser.parse_args()
    if not BASE_TAR.is_file():
        raise SystemExit(f"needs the lab's base tar {BASE_TAR}: slurm-multi lab pytorch-base")
    print(f"base: {BASE_TAR} ({BASE_TAR.stat().st_size / 1e9:.2f} GB), {NODES} nodes, {options.rebuilds} rebuilds")
    with tempfile.TemporaryDirectory(prefix="ch-rebuild-bench-", dir="/var/tmp") as work_dir:
        work = Path(work_dir)
        zoo = Zoo(work / "zoo")
        cache = CacheDirectory(str(work / "cache"))
        build = CharliecloudBuild(cache, str(work / "storage"), {BASE: str(BASE_TAR)})

        first_s, (outcome, squashfs) = timed(ensure_image, cache, zoo.plan(work), build)
        print(f"first build (base imported, built, squashed, committed): {first_s:.1f} s, {outcome.action}")
        rows = []
        for _ in range(options.rebuilds):
            build_s, (outcome, squashfs) = timed(ensure_image, cache, zoo.plan(work), build)
            ready_s = ready_in_place(squashfs, outcome.image_id, str(work / "unused"))
            unpack_s = ready_unpacked(squashfs, outcome.image_id, work)
            reimport = CharliecloudBuild(cache, str(work / f"fresh-{uuid.uuid4().hex[:6]}"), build.bases)
            fresh_s, _ = timed(ensure_image, cache, zoo.plan(work), reimport)
            shutil.rmtree(reimport.storage_dir, ignore_errors=True)
            rows.append((build_s, ready_s, unpack_s, fresh_s))
        size = os.path.getsize(squashfs)
        build_s, ready_s, unpack_s, fresh_s = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"\none-file rebuild over the base, until {NODES} nodes are ready (median of {len(rows)}):")
        print(f"  slurm-multi (base kept), in place:      {build_s + ready_s:6.1f} s  (build+squash {build_s:.1f}, "
              f"ready {ready_s:.2f}); squashfs {size / 1e6:.0f} MB")  # fmt: skip
        print(f"  slurm-multi (base kept), FUSE-less:     {build_s + unpack_s:6.1f} s  (unpack on {NODES} nodes at "
              f"once {unpack_s:.1f})")  # fmt: skip
        print(f"  base imported again for each build:    {fresh_s + ready_s:6.1f} s  "
              f"({(fresh_s + ready_s) / (build_s + ready_s):.1f}x)")  # fmt: skip

        run(ch_image_argv(["build", "-t", "tree", "-f", zoo.plan(work).dockerfile, "--build-arg",
                           f"BASE_DOCKER={BASE}", str(zoo.root / "docker")]), build.env)  # fmt: skip
        tree = image_tree(build, "tree")
        print("\nmksquashfs of the model's tree (1 run each):")
        for label, (seconds, size) in squash_variants(tree, work).items():
            print(f"  {label:28s} {seconds:5.1f} s  {size / 1e6:5.0f} MB")
        copy_s, append_s = append_variant(image_tree(build, BASE), work)
        print(f"  append one file to a copy of the base's squashfs: copy {copy_s:.1f} s + append {append_s:.1f} s")

        if not options.skip_cache:
            import_s, cached_first, cached_rebuild = cache_variant(zoo, work, options.rebuilds)
            print(f"\nch-image with its build cache (git): import {import_s:.1f} s, first build {cached_first:.1f} s, "
                  f"one-file rebuild {cached_rebuild:.1f} s (median; no squashfs)")  # fmt: skip


if __name__ == "__main__":
    main()
