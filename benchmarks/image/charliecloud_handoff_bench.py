"""The lab's 1.05 GB PyTorch image ready on every node: Charliecloud's shared squashfs against Docker's tar cache.

Run on the lab as root (`slurm-multi lab up --nodes 8` for 8 nodes; the PyTorch base tar from `slurm-multi lab
pytorch-base`):

    python -m benchmarks.image.charliecloud_handoff_bench [--nodes 3 8] [--repeat 1]

The image is the lab's PyTorch base (slurm_multi/lab/pytorch.py): Docker's `PYTORCH_BASE` on node1, and the same
root filesystem in Charliecloud's store, brought in once with `ch-image import` by the user of a site without Docker
(tests/support/users/local_users.NODOCKER), untimed. For each node count (node1..nodeN, rank 0 is node1), the page
cache dropped before each timed run, variants in one run:

* raw floor: `docker save` on node1 into a shared dir, then `docker load` on every worker in parallel;
* tar cache: `playbooks/build.yml` with image_transport cache and an empty cache dir (rank 0 publishes the tar,
  every worker loads it: module_utils/image/cache/), then every node's first `import torch` in a container;
* squashfs in place: rank 0's `mksquashfs` of the store's image into the shared dir (zstd level 1, named by its
  sha256, as the cache names it), then every node's first `import torch` through `ch-run` of that one file, as the
  user: nothing is copied, each node reads only the pages the import touches (SquashFUSE);
* unpack fallback (a node with no FUSE): the same file unpacked on every node at once into node-local storage
  (`unsquashfs` into a temp name, renamed when complete), then the import through `ch-run` of the directory.

Reported per variant: seconds until every node ran (or could run) the image, and the bytes each node reads from the
shared dir: the tar for Docker's variants, the whole squashfs for the unpack, and for the squashfs in place the
pages one node's import brings in (measured on node1 alone: the file's pages dropped from the page cache, then
counted with `fincore` after the import, read-ahead included). On the lab every node shares one disk and page cache;
on a cluster each node reads those bytes from the shared filesystem. The machine is a shared 2-core box.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.e2e_bench import on
from benchmarks.image.distribution_bench import bench_manifest, drop_caches
from benchmarks.image.image_handoff_bench import playbook
from slurm_multi.lab.pytorch import BASE_TAR, PYTORCH_BASE, ensure_pytorch_base
from tests.support.users.local_users import NODOCKER, setpriv_argv
from tests.support.users.no_docker import ensure_nodocker_user

IMPORT = "import torch"
# The image's name in the user's Charliecloud store.
CH_IMAGE_NAME = "slurm-multi-bench-pytorch"
# Node-local places (the lab's /var/tmp is one disk, a per-node folder each).
STORE = Path("/var/tmp/slurm-multi-bench-ch-store")
UNPACK = Path("/var/tmp/slurm-multi-bench-ch-unpack")
# The choice: fast to write, read by every node.
MKSQUASHFS_OPTIONS = ("-comp", "zstd", "-Xcompression-level", "1", "-noappend", "-quiet", "-no-progress")
# The anchors the figures stand beside (docs/figures.md).
ANCHORS = (
    "soperator's squashfs image cache on SLURM: first node 117.9 s, a node with it cached 15.8 s",
    "pyxis's shared-image option (one squashfs for every task) halved a suite: 40 to 20 min",
)


def as_user(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """`argv` run to its end as NODOCKER, with the system's commands (ch-image runs on Debian's python3) and
    nothing of root's environment."""
    home = pwd.getpwnam(NODOCKER).pw_dir
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={home}", f"USER={NODOCKER}", f"CH_IMAGE_STORAGE={STORE}"]
    result = subprocess.run(setpriv_argv(NODOCKER, [*env, *argv]), capture_output=True, text=True, cwd="/")
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return result


def import_into_store() -> float:
    """The base in NODOCKER's Charliecloud store (`ch-image import` of the lab's base tar); its seconds."""
    start = time.perf_counter()
    as_user(["ch-image", "--no-cache", "import", str(BASE_TAR), CH_IMAGE_NAME])
    return time.perf_counter() - start


def publish_squashfs(shared: Path) -> dict:
    """Rank 0's publish: the store's image to `<shared>/<sha256>.sqfs`, written under a temp name and renamed."""
    partial = shared / ".publishing.sqfs"
    drop_caches()
    start = time.perf_counter()
    as_user(["mksquashfs", str(STORE / "img" / CH_IMAGE_NAME), str(partial), *MKSQUASHFS_OPTIONS])
    digest = hashlib.sha256()
    with open(partial, "rb") as image:
        for block in iter(lambda: image.read(1 << 20), b""):
            digest.update(block)
    squashfs = shared / f"{digest.hexdigest()}.sqfs"
    os.replace(partial, squashfs)
    return {"seconds": time.perf_counter() - start, "path": squashfs, "size": squashfs.stat().st_size}


def _evict(path: Path) -> None:
    """Drop `path`'s pages from the page cache (its own pages only)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    return int(out.stdout.split()[0])


def squashfs_bytes_per_node(squashfs: Path) -> int:
    """The bytes of the shared file one node's first import reads: node1 alone, the file's pages evicted first."""
    _evict(squashfs)
    before = _resident_bytes(squashfs)
    as_user(["srun", "-N1", "-w", "node1", "--quiet", "ch-run", str(squashfs), "--", "python3", "-c", IMPORT])
    return _resident_bytes(squashfs) - before


def in_place(squashfs: Path, nodes: int) -> dict:
    """Every node's first import through ch-run of the one shared file, at once."""
    drop_caches()
    start = time.perf_counter()
    as_user(
        ["srun", "-N", str(nodes), "-w", f"node[1-{nodes}]", "--quiet", "ch-run", str(squashfs), "--"]
        + ["python3", "-c", IMPORT]
    )
    return {"seconds": time.perf_counter() - start}


# Each node: the file unpacked under a temp name, renamed when complete (a torn unpack is never run), then run.
UNPACK_SCRIPT = """set -e
place={unpack}/$SLURMD_NODENAME
rm -rf "$place" && mkdir -p "$place"
unsquashfs -q -n -d "$place/{name}.partial" {squashfs} >/dev/null
mv "$place/{name}.partial" "$place/{name}"
ch-run "$place/{name}" -- python3 -c '{code}'
"""


def unpack_fallback(squashfs: Path, nodes: int) -> dict:
    """Every node unpacks the shared file into its own storage at once, then imports from the directory."""
    script = UNPACK_SCRIPT.format(unpack=UNPACK, name=squashfs.stem, squashfs=squashfs, code=IMPORT)
    drop_caches()
    start = time.perf_counter()
    as_user(["srun", "-N", str(nodes), "-w", f"node[1-{nodes}]", "--quiet", "sh", "-c", script])
    elapsed = time.perf_counter() - start
    unpacked = int(
        subprocess.run(["du", "-sb", str(UNPACK / "node1")], capture_output=True, text=True).stdout.split()[0]
    )
    as_user(["rm", "-rf", *(str(UNPACK / f"node{i}") for i in range(1, nodes + 1))])
    return {"seconds": elapsed, "written": unpacked}


def forget_base(workers: list[str]) -> None:
    """No worker holds any layer of the base: every image whose layers start with the base's is removed (an earlier
    job's model image keeps the base's layer after its tag is gone, and a load then skips it)."""
    inspect = ["docker", "image", "inspect", "--format", "{{.Id}} {{range .RootFS.Layers}}{{.}} {{end}}"]
    base_layer = on("node1", *inspect, PYTORCH_BASE).stdout.split()[1]
    for node in workers:
        images = on(node, "docker", "images", "-a", "-q", "--no-trunc", check=False).stdout.split()
        listed = on(node, *inspect, *images, check=False).stdout.splitlines() if images else []
        holding = sorted({line.split()[0] for line in listed if base_layer in line.split()[1:2]})
        if holding:
            on(node, "docker", "rmi", "-f", *holding, check=False)


def raw_floor(workdir: Path, workers: list[str]) -> dict:
    """`docker save` on node1, `docker load` on every worker in parallel."""
    forget_base(workers)
    tar = workdir / "raw.tar"
    drop_caches()
    start = time.perf_counter()
    on("node1", "docker", "save", "-o", str(tar), PYTORCH_BASE)
    loads = [
        subprocess.Popen(
            ["srun", "-N1", "-w", node, "--quiet", "docker", "load", "-q", "-i", str(tar)], stdout=subprocess.DEVNULL
        )
        for node in workers
    ]
    if any(load.wait() for load in loads):
        raise RuntimeError("a worker's docker load failed")
    elapsed = time.perf_counter() - start
    size = tar.stat().st_size
    tar.unlink()
    return {"seconds": elapsed, "size": size}


def tar_cache(workdir: Path, manifest: Path, nodes: int, run: int) -> dict:
    """The build stage's handoff through an empty tar cache, then every node's first import in a container."""
    workers = [f"node{i}" for i in range(2, nodes + 1)]
    forget_base(workers)
    cache = workdir / f"cache-{nodes}-{run}"
    figures = playbook(workdir, manifest, cache, nodes)
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    docker_run = ["docker", "run", "--rm", "--network=host", PYTORCH_BASE, "python3", "-c", IMPORT]
    subprocess.run(
        ["srun", "-N", str(nodes), "-w", f"node[1-{nodes}]", "--quiet", *docker_run], check=True, capture_output=True
    )
    figures["first_import"] = time.perf_counter() - start
    figures["per_worker"] = figures["cache_read"] / max(len(workers), 1)
    return figures


def bench(node_counts: list[int], repeat: int) -> dict:
    ensure_nodocker_user()
    ensure_pytorch_base(["node1"], progress=lambda _: None)
    image_id = on("node1", "docker", "image", "inspect", "--format", "{{.Id}}", PYTORCH_BASE).stdout.strip()
    workdir = Path(tempfile.mkdtemp(prefix="bench-ch-handoff-", dir="/tmp"))
    workdir.chmod(0o755)  # the user reaches its squashfs cache in it
    shared = workdir / "squashfs-cache"
    shared.mkdir()
    user = pwd.getpwnam(NODOCKER)
    os.chown(shared, user.pw_uid, user.pw_gid)
    figures = {"import": import_into_store(), "nodes": {}}
    try:
        manifest = bench_manifest(workdir, image_id, PYTORCH_BASE)
        publishes = []
        for nodes in node_counts:
            workers = [f"node{i}" for i in range(2, nodes + 1)]
            runs = figures["nodes"][nodes] = {"floor": [], "cache": [], "in_place": [], "unpack": []}
            for run in range(repeat):
                published = publish_squashfs(shared)
                publishes.append(published)
                runs["floor"].append(raw_floor(workdir, workers))
                runs["cache"].append(tar_cache(workdir, manifest, nodes, run))
                runs["in_place"].append(dict(in_place(published["path"], nodes), publish=published["seconds"]))
                runs["unpack"].append(dict(unpack_fallback(published["path"], nodes), publish=published["seconds"]))
        squashfs = publishes[-1]["path"]
        figures["squashfs_size"] = publishes[-1]["size"]
        figures["squashfs_per_node"] = squashfs_bytes_per_node(squashfs)
    finally:
        forget_base([f"node{i}" for i in range(2, max(node_counts) + 1)])
        shutil.rmtree(workdir, ignore_errors=True)
        as_user(["rm", "-rf", str(UNPACK)], check=False)
    return figures


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.0f} MB"


def report(figures: dict, node_counts: list[int]) -> None:
    med = statistics.median
    print(f"the lab's PyTorch base ({_gb(BASE_TAR.stat().st_size)} root filesystem tar); page cache dropped per run")
    print(f"ch-image import of the base into the user's store (once, untimed): {figures['import']:.1f} s")
    print(f"squashfs (zstd level 1): {_gb(figures['squashfs_size'])}")
    for nodes in node_counts:
        runs = figures["nodes"][nodes]
        floor = med(r["seconds"] for r in runs["floor"])
        tar = runs["floor"][0]["size"]
        cache = runs["cache"]
        cache_ready = med(r["seconds"] for r in cache)
        first = med(r["first_import"] for r in cache)
        publish = med(r["publish"] for r in runs["in_place"])
        in_place = med(r["seconds"] for r in runs["in_place"])
        unpack = med(r["seconds"] for r in runs["unpack"])
        print(f"\n{nodes} nodes (rank 0 is node1)                      seconds   bytes each node reads")
        print(f"  docker raw floor (save + parallel load)       {floor:7.1f}   {_gb(tar)} (each worker)")
        print(
            f"  docker tar cache (publish + slowest load)     {cache_ready:7.1f}   "
            f"{_gb(med(r['per_worker'] for r in cache))} (each worker); then first import {first:.1f} s: "
            f"{cache_ready + first:.1f} s"
        )
        print(
            f"  charliecloud squashfs in place                {publish + in_place:7.1f}   "
            f"{_gb(figures['squashfs_per_node'])} (one node's import); mksquashfs {publish:.1f} s + every node's "
            f"first import {in_place:.1f} s"
        )
        print(
            f"  charliecloud unpack fallback (no FUSE)        {publish + unpack:7.1f}   "
            f"{_gb(figures['squashfs_size'])} (the whole file), writes {_gb(runs['unpack'][0]['written'])}; "
            f"unpack + first import {unpack:.1f} s"
        )
    print("\nanchors:")
    for anchor in ANCHORS:
        print(f"  {anchor}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 8], help="node counts, each measured in turn")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run it as root: it acts as the user of a site without Docker, and on every node's daemon")
        return 2
    report(bench(args.nodes, args.repeat), args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
