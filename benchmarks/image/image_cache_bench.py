#!/usr/bin/env python3
"""The image cache's distribution of one image from rank 0 to two workers, against the raw Docker floor.

Three private Docker daemons of this script's own stand for rank 0 and two workers; the cache directory is a
local directory all three see. The image is busybox plus a layer of random bytes (200 MB by default). Each
repeat times, side by side (their order alternates):

    raw floor   `docker save -o TAR` on rank 0, then `docker load -i TAR` on both workers in parallel
    ours        publish_image on rank 0 (into an empty cache dir), then load_image on both workers
                in parallel (one streamed read each, hashed, held back until verified, ID checked)

and reports ours / raw (target: <= 1.15). Then the path where every node has the image already: publish of a
committed entry and load on a worker that has the ID, per node (target: < 0.5 s each).

The page cache is dropped before each timed run where the machine allows it (`sync; echo 3 >
/proc/sys/vm/drop_caches`); the report says whether it could. Needs root (it starts dockerd).

    .venv/bin/python -m benchmarks.image.image_cache_bench                   # 200 MB, 3 repeats
    .venv/bin/python -m benchmarks.image.image_cache_bench --size-mb 50 --repeat 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from tests.support.dockerd import PrivateDockerd, build_busybox_image

TAG = "slurm-multi-bench/big:latest"
RATIO_TARGET = 1.15
PRESENT_TARGET_SECONDS = 0.5


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False where the machine does not allow it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        return True
    except OSError:
        return False


def unmount_leftovers(base: Path) -> None:
    """Unmount what the daemons left mounted under `base` (dockerd leaves its exec root's netns mount)."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{base}/")]
    for point in reversed(points):
        subprocess.run(["umount", point], check=False)


def remove_image(daemon: PrivateDockerd, image_id: str) -> None:
    daemon.docker("rmi", "-f", image_id, check=False)


def in_parallel(*calls):
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def timed(call):
    started = time.monotonic()
    call()
    return time.monotonic() - started


def raw_floor(rank0, workers, work_dir: Path) -> dict:
    """`docker save` to a file, then parallel `docker load`s: what Docker itself needs."""
    tar = work_dir / "raw.tar"
    save = timed(lambda: run_docker(["save", "-o", str(tar), TAG], timeout=3600, host=rank0.host))
    loads = in_parallel(
        *[
            (lambda worker=worker: timed(lambda: run_docker(["load", "-i", str(tar)], timeout=3600, host=worker.host)))
            for worker in workers
        ]
    )
    tar.unlink()
    return {"save": save, "loads": loads, "total": save + max(loads)}


def ours(rank0, workers, cache_dir: Path, image_id: str) -> dict:
    """Publish on rank 0, then load on every worker in parallel, through the module's functions."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    started = time.monotonic()
    published = publish_image(CacheDirectory(str(cache_dir), docker_host=rank0.host), TAG)
    loads = in_parallel(
        *[
            (
                lambda worker=worker: load_image(
                    CacheDirectory(str(cache_dir), docker_host=worker.host), image_id, image=TAG
                )
            )
            for worker in workers
        ]
    )
    total = time.monotonic() - started
    assert published.action_taken == "saved" and all(load.action_taken == "loaded" for load in loads)
    return {"save": published.seconds, "loads": [load.seconds for load in loads], "total": total}


def already_present(rank0, workers, cache_dir: Path, image_id: str) -> dict:
    """Every node has the image (and the entry is committed): publish and loads that change nothing."""
    published = publish_image(CacheDirectory(str(cache_dir), docker_host=rank0.host), TAG)
    loads = [
        load_image(CacheDirectory(str(cache_dir), docker_host=worker.host), image_id, image=TAG) for worker in workers
    ]
    assert published.action_taken == "already-present"
    assert all(load.action_taken == "already-present" for load in loads)
    return {"publish": published.seconds, "loads": [load.seconds for load in loads]}


def build_big_image(rank0: PrivateDockerd, size_mb: int) -> str:
    return build_busybox_image(
        rank0, TAG, extra_dockerfile="COPY blob /blob\n", extra_files={"blob": os.urandom(size_mb << 20)}
    )


def run(size_mb: int, repeat: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-cachebench-"))
    daemons = [PrivateDockerd(base / name) for name in ("rank0", "worker1", "worker2")]
    try:
        for daemon in daemons:
            daemon.start()
        rank0, workers = daemons[0], daemons[1:]
        image_id = build_big_image(rank0, size_mb)
        size = rank0.docker("image", "inspect", "--format", "{{.Size}}", TAG).stdout.strip()
        print(f"image {TAG} {image_id[:19]} ({int(size) / 1e6:.0f} MB), rank 0 -> {len(workers)} workers")
        cache_dir = base / "docker-builds"
        ratios, phase_ratios, dropped = [], {"save": [], "loads": []}, True
        for attempt in range(repeat):
            figures = {}
            order = ("raw", "ours") if attempt % 2 == 0 else ("ours", "raw")
            for which in order:
                for worker in workers:
                    remove_image(worker, image_id)
                dropped = drop_page_cache() and dropped
                if which == "raw":
                    figures[which] = raw_floor(rank0, workers, base)
                else:
                    figures[which] = ours(rank0, workers, cache_dir, image_id)
            ratio = figures["ours"]["total"] / figures["raw"]["total"]
            ratios.append(ratio)
            phase_ratios["save"].append(figures["ours"]["save"] / figures["raw"]["save"])
            phase_ratios["loads"].append(max(figures["ours"]["loads"]) / max(figures["raw"]["loads"]))
            for which in ("raw", "ours"):
                f = figures[which]
                print(
                    f"  repeat {attempt + 1} {which:4}: save/publish {f['save']:6.2f} s, loads "
                    f"{' / '.join(f'{s:.2f}' for s in f['loads'])} s, total {f['total']:6.2f} s"
                )
            print(f"  repeat {attempt + 1} ratio ours/raw: {ratio:.3f}")
        print(
            f"ratio ours/raw: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
            f", target <= {RATIO_TARGET}"
        )
        print(
            f"  by phase (median): publish/save {statistics.median(phase_ratios['save']):.3f}, "
            f"slowest load ours/raw {statistics.median(phase_ratios['loads']):.3f}"
        )
        present = [already_present(rank0, workers, cache_dir, image_id) for _ in range(repeat)]
        worst_load = max(max(p["loads"]) for p in present)
        worst_publish = max(p["publish"] for p in present)
        print(
            f"already present: publish max {worst_publish:.3f} s, load per worker max {worst_load:.3f} s "
            f"(target < {PRESENT_TARGET_SECONDS} s per node)"
        )
        print(
            "page cache dropped before each run"
            if dropped
            else "page cache NOT dropped (not allowed here): reads may come from memory"
        )
    finally:
        for daemon in daemons:
            daemon.stop()
        unmount_leftovers(base)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=200, help="size of the image's random layer (MB)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of each measurement")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("this benchmark starts its own dockerd daemons: run it as root")
    run(args.size_mb, args.repeat)


if __name__ == "__main__":
    main()
