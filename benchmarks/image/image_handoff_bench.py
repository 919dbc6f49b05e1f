"""Rank 0's image handed to every node: the tar cache (whole and layered) against the raw floor, side by side.

Run on the lab (`slurm-multi lab up --nodes 8`):
    python -m benchmarks.image.image_handoff_bench [--size-mb 200 2048] [--nodes 3 8] [--repeat 1]
    python -m benchmarks.image.image_handoff_bench --base-everywhere ...   # a small layer over a base every node holds

The image moved is a model's one-file layer over a base (busybox plus a layer of random bytes, built on node1, as a
`rocm/pytorch`). With --base-everywhere every worker holds the base before the timed runs (an earlier job brought
it): what a node lacks is a few KB, while `docker save` still writes the base. Without it, no worker holds any of it.

For each image size and each node count, rank 0 (node1) to the other nodes, the page cache dropped before each timed
run, variants in one run:

* raw floor: `docker save -o TAR` on node1 into a shared directory, then `docker load -i TAR` on every worker in
  parallel (distribution_bench.py's floor, for N nodes);
* tar cache: `playbooks/build.yml` with image_transport cache and an empty cache dir (publish on node1 saves the
  whole image, then every worker loads what it lacks from the tar);
* layers: the same, the cache dir already holding the base's entry (an earlier job published it) and node1's daemon
  naming the base's layers by a registry digest (as a base pulled from a registry; here pushed once to the lab's
  registry, untimed): the publish pushes only the model's layer and config (module_utils/image/cache/publish.py).

Reported per variant: the image modules' own seconds (publish + slowest load), the playbook's wall time, and the
bytes read back from the shared cache dir (the floor: the tar once per worker; cache: what the load tasks read).
With several node counts, each variant's growth from the first count to the last is printed too. The machine is a
shared 2-core box: every lab node's loads share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from benchmarks.image.distribution_bench import BIN, bench_manifest, drop_caches, on
from slurm_multi.lab.cluster import lab_nodes
from tests.support.ansible import task_results

ROOT = Path(__file__).resolve().parents[2]

TAG = "slurm-multi-bench/handoff:latest"
BASE_TAG = "slurm-multi-bench/handoff-base:latest"
REGISTRY = "127.0.0.1:17500"  # the lab's registry (slurm_multi/lab/cluster.py)
# One task: rank 0's result is the publish, the workers' the loads.
PUBLISH_TASK = LOAD_TASK = "Hand rank 0's image to every node through the shared tar cache"


def build_image(size_mb: int) -> str:
    """TAG on node1: a one-file layer over BASE_TAG (busybox plus `size_mb` of random bytes); its ID."""
    ctx = Path(tempfile.mkdtemp(prefix="bench-handoff-ctx-", dir="/tmp"))
    with open(ctx / "payload.bin", "wb") as handle:
        for _ in range(size_mb):
            handle.write(os.urandom(1 << 20))
    (ctx / "Dockerfile").write_text("FROM slurm-multi-lab/busybox:latest\nCOPY payload.bin /payload.bin\n")
    try:
        on("node1", "docker", "build", "-q", "--network=host", "-t", BASE_TAG, str(ctx))
        (ctx / "Dockerfile").write_text(f"FROM {BASE_TAG}\nRUN echo model > /model.txt\n")
        on("node1", "docker", "build", "-q", "--network=host", "-t", TAG, str(ctx))
    finally:
        shutil.rmtree(ctx)
    return on("node1", "docker", "image", "inspect", "--format", "{{.Id}}", TAG).stdout.strip()


def share_base(workdir: Path, workers) -> None:
    """BASE_TAG onto every worker, untimed: the base they hold before the job."""
    tar = workdir / "base.tar"
    on("node1", "docker", "save", "-o", str(tar), BASE_TAG)
    for node in workers:
        on(node, "docker", "load", "-q", "-i", str(tar))
    tar.unlink()


def seed_cache(workdir: Path) -> Path:
    """A cache dir holding the base's entry, and the base's layers named by a registry digest on node1; untimed."""
    remote = f"{REGISTRY}/{BASE_TAG}"
    on("node1", "docker", "tag", BASE_TAG, remote)
    on("node1", "docker", "push", "-q", remote)
    on("node1", "docker", "rmi", remote)
    seeded = workdir / "seeded"
    publish_image(CacheDirectory(str(seeded), docker_host=f"unix://{lab_nodes(1)[0].docker_socket}"), BASE_TAG)
    return seeded


def forget(workers):
    for node in workers:
        subprocess.run(["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", TAG], capture_output=True)


def raw_floor(workdir: Path, workers) -> dict:
    forget(workers)
    tar = workdir / "raw.tar"
    drop_caches()
    start = time.perf_counter()
    on("node1", "docker", "save", "-o", str(tar), TAG)
    saved = time.perf_counter() - start
    loads = [
        subprocess.Popen(
            ["srun", "-N1", "-w", n, "--quiet", "docker", "load", "-q", "-i", str(tar)], stdout=subprocess.DEVNULL
        )
        for n in workers
    ]
    if any(p.wait() for p in loads):
        raise RuntimeError("raw docker load failed")
    elapsed = time.perf_counter() - start
    size = tar.stat().st_size
    tar.unlink()
    return {"seconds": elapsed, "save": saved, "cache_read": size * len(workers), "size": size}


def playbook(workdir: Path, manifest: Path, cache: Path, nodes: int) -> dict:
    results = workdir / "results"
    results.mkdir(exist_ok=True)
    variables = {
        "manifest_path": str(manifest),
        "image_cache_dir": str(cache),
        "results_dir": str(results),
        "image_transport": "cache",
    }
    drop_caches()
    start = time.perf_counter()
    out = subprocess.run(
        ["salloc", "-N", str(nodes), "-w", f"node[1-{nodes}]", "--quiet", str(BIN / "ansible-playbook")]
        + ["playbooks/build.yml", "-f", str(nodes), "-v", "-e", json.dumps(variables)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_CALLBACK_FORMAT_PRETTY="0"),
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-2000:])
    tasks = task_results(out.stdout)
    publish = tasks[PUBLISH_TASK]["node1"]
    loads = {host: result for host, result in tasks[LOAD_TASK].items() if host != "node1"}
    return {
        "wall": wall,
        "seconds": publish["seconds"] + max(r["seconds"] for r in loads.values()),
        "actions": dict({"node1": publish["action_taken"]}, **{h: r["action_taken"] for h, r in loads.items()}),
        "publish": publish["seconds"],
        "written": publish["bytes"],
        "load": max(r["seconds"] for r in loads.values()),
        "cache_read": sum(r["bytes"] for r in loads.values() if r["action_taken"] == "loaded"),
    }


VARIANTS = ("floor", "cache", "layers")


def bench_size(size_mb: int, node_counts, repeat: int, base_everywhere: bool) -> dict:
    """{nodes: {"floor": [...], "cache": [...], "layers": [...]}} for one size."""
    everyone = [f"node{i}" for i in range(2, max(node_counts) + 1)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir="/tmp"))
    figures = {}
    try:
        manifest = bench_manifest(workdir, build_image(size_mb), TAG)
        if base_everywhere:
            share_base(workdir, everyone)
        seeded = seed_cache(workdir)
        for nodes in node_counts:
            workers = everyone[: nodes - 1]
            figures[nodes] = {variant: [] for variant in VARIANTS}
            for run in range(repeat):
                figures[nodes]["floor"].append(raw_floor(workdir, workers))
                for variant in VARIANTS[1:] if run % 2 == 0 else VARIANTS[:0:-1]:
                    forget(workers)
                    cache = workdir / f"cache-{variant}-{nodes}-{run}"
                    if variant == "layers":  # the base's entry, linked: entries are immutable
                        shutil.copytree(seeded, cache, copy_function=os.link)
                    figures[nodes][variant].append(playbook(workdir, manifest, cache, nodes))
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        forget(everyone)
        for node in ["node1", *everyone]:
            subprocess.run(
                ["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", TAG, BASE_TAG], capture_output=True
            )
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


def _size(size: float) -> str:
    return next(
        f"{size / scale:.2f} {unit}"
        for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B"))
        if size >= scale or scale == 1
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, nargs="+", default=[200, 2048])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3], help="node counts, each measured in turn")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--base-everywhere", action="store_true", help="a small layer over a base every node holds")
    args = parser.parse_args()
    med = statistics.median
    print(f"node counts {args.nodes}, {args.repeat} run(s) per variant (medians)")
    print("page cache dropped before each run; shared 2-core machine: every lab node's docker load shares its cores")
    for size_mb in args.size_mb:
        figures = bench_size(size_mb, args.nodes, args.repeat, args.base_everywhere)
        where = (
            "a one-file layer over a base every worker holds"
            if args.base_everywhere
            else "a one-file layer over a base no worker holds"
        )
        print(f"\n{size_mb} MB image ({where})")
        seconds = {}
        for nodes in args.nodes:
            runs = figures[nodes]
            floor = med(f["seconds"] for f in runs["floor"])
            seconds[nodes] = {"floor": floor}
            print(f"  {nodes} nodes (rank 0 -> {nodes - 1} workers), {runs['floor'][0]['size'] / 1e9:.2f} GB tar")
            print(
                f"    raw floor (save {med(f['save'] for f in runs['floor']):.2f} s + parallel loads)  {floor:7.2f} s"
                f"   cache dir read {runs['floor'][0]['cache_read'] / 1e9:.2f} GB"
            )
            for name in VARIANTS[1:]:
                took, wall = med(r["seconds"] for r in runs[name]), med(r["wall"] for r in runs[name])
                seconds[nodes][name] = took
                print(
                    f"    {name:6} modules {took:7.2f} s ({took / floor:.2f}x floor)   playbook wall {wall:7.2f} s"
                    f"   cache dir read {_size(max(r['cache_read'] for r in runs[name]))}"
                    f"   {runs[name][-1]['actions']}"
                )
                publish, load = med(r["publish"] for r in runs[name]), med(r["load"] for r in runs[name])
                written = med(r["written"] for r in runs[name])
                print(f"           publish {publish:.2f} s (wrote {_size(written)}), slowest load {load:.2f} s")
        if len(args.nodes) > 1:
            low, high = args.nodes[0], args.nodes[-1]
            growth = "   ".join(f"{name} {seconds[high][name] / seconds[low][name] - 1:+.0%}" for name in VARIANTS)
            print(f"  growth from {low} to {high} nodes: {growth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
