"""Distributing a 200 MB image from rank 0 to 2 workers on the lab cluster: the real path vs the raw floor.

Run on the lab cluster (`slurm-multi lab up`):
    python -m benchmarks.image.distribution_bench [--size-mb 200] [--repeat 2]

* real path: `ansible-playbook playbooks/build.yml` in `salloc -N 3` with a MAD manifest naming the image, so the
  build stage publishes it into the tar cache on node1, loads it on node2 and node3 in parallel (one fork per
  node) and holds the image-ready barrier. Reported both as the playbook's wall time and as the image_cache
  tasks' own seconds (publish + slowest load), which excludes Ansible's fixed per-task cost.
* raw floor: `docker save` on node1 to the shared disk, then `docker load` on node2 and node3 in parallel.
* already there: the same playbook again, every node holding the image (per node: the load task's seconds).

The page cache is dropped before each run when the machine allows it; variants alternate within one run.
"""

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

from tests.support.ansible import task_results

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TAG = "slurm-multi-bench/distribution:latest"


def sh(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def on(node, *argv):
    return sh(["srun", "-N1", "-w", node, "--quiet", *argv])


def drop_caches():
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def build_image(size_mb: int) -> str:
    ctx = Path(tempfile.mkdtemp(prefix="bench-ctx-", dir="/tmp"))
    with open(ctx / "payload.bin", "wb") as handle:
        for _ in range(size_mb):
            handle.write(os.urandom(1 << 20))
    (ctx / "Dockerfile").write_text("FROM slurm-multi-lab/busybox:latest\nCOPY payload.bin /payload.bin\n")
    on("node1", "docker", "build", "-q", "--network=host", "-t", TAG, str(ctx))
    shutil.rmtree(ctx)
    return on("node1", "docker", "image", "inspect", "--format", "{{.Id}}", TAG).stdout.strip()


def forget_on_workers():
    for node in ("node2", "node3"):
        subprocess.run(["srun", "-N1", "-w", node, "--quiet", "docker", "rmi", "-f", TAG], capture_output=True)


def raw_floor(workdir: Path) -> float:
    forget_on_workers()
    tar = workdir / "raw.tar"
    drop_caches()
    start = time.perf_counter()
    on("node1", "docker", "save", "-o", str(tar), TAG)
    loads = [
        subprocess.Popen(
            ["srun", "-N1", "-w", n, "--quiet", "docker", "load", "-q", "-i", str(tar)], stdout=subprocess.DEVNULL
        )
        for n in ("node2", "node3")
    ]
    if any(p.wait() for p in loads):
        raise RuntimeError("raw docker load failed")
    elapsed = time.perf_counter() - start
    tar.unlink()
    return elapsed


def bench_manifest(workdir: Path, image_id: str, tag: str = TAG) -> Path:
    """A build manifest naming the bench's image (``tag``, ``image_id``) as the sample model's."""
    manifest = workdir / "build_manifest.json"
    entry = {"docker_image": tag, "image_id": image_id, "dockerfile": "", "build_fingerprint": ""}
    card = {"name": "bench", "scripts": "scripts/dummy/run.sh", "args": ""}
    manifest.write_text(
        json.dumps({"built_images": {tag: entry}, "built_models": {tag: card}, "context": {}, "deployment_config": {}})
    )
    return manifest


def real_path(workdir: Path, manifest: Path, cache: Path) -> dict:
    results = workdir / "results"
    results.mkdir(exist_ok=True)
    variables = {"manifest_path": str(manifest), "image_cache_dir": str(cache), "results_dir": str(results)}
    drop_caches()
    start = time.perf_counter()
    out = subprocess.run(
        [
            "salloc",
            "-N",
            "3",
            "--quiet",
            str(BIN / "ansible-playbook"),
            "playbooks/build.yml",
            "-f",
            "3",
            "-v",
            "-e",
            json.dumps(variables),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_CALLBACK_FORMAT_PRETTY="0"),
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-2000:])
    tasks = task_results(out.stdout)
    # One task: rank 0's result is the publish, the workers' the loads.
    publish = tasks["Hand rank 0's image to every node through the shared tar cache"]["node1"]
    loads = tasks["Hand rank 0's image to every node through the shared tar cache"]
    return {
        "wall": wall,
        "modules": publish["seconds"] + max(loads[n]["seconds"] for n in ("node2", "node3")),
        "publish_action": publish["action_taken"],
        "load_seconds": {n: loads[n]["seconds"] for n in ("node2", "node3")},
        "load_actions": {n: loads[n]["action_taken"] for n in ("node2", "node3")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-distribution-", dir="/tmp"))
    image_id = build_image(args.size_mb)
    manifest = bench_manifest(workdir, image_id)
    raw, real, modules = [], [], []
    try:
        for _ in range(args.repeat):
            raw.append(raw_floor(workdir))
            cache = workdir / f"cache-{len(real)}"
            forget_on_workers()
            result = real_path(workdir, manifest, cache)
            assert result["publish_action"] == "saved" and set(result["load_actions"].values()) == {"loaded"}, result
            real.append(result["wall"])
            modules.append(result["modules"])
        again = real_path(workdir, manifest, cache)
    finally:
        forget_on_workers()
        subprocess.run(["srun", "-N1", "-w", "node1", "--quiet", "docker", "rmi", "-f", TAG], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    med = statistics.median
    print(f"{args.size_mb} MB image, rank 0 -> 2 workers, {args.repeat} runs each (medians)")
    print(f"  raw floor (docker save + 2 parallel docker load)   {med(raw):6.2f} s")
    print(
        f"  real path, image_cache tasks (publish + load)      {med(modules):6.2f} s   "
        f"ratio {med(modules) / med(raw):.2f}x"
    )
    print(
        f"  real path, whole build.yml playbook (wall)         {med(real):6.2f} s   ratio {med(real) / med(raw):.2f}x"
    )
    per_node = ", ".join(
        f"{node} {seconds:.2f} s ({again['load_actions'][node]})" for node, seconds in again["load_seconds"].items()
    )
    print(f"  already on every node: load task per worker        {per_node}")
    print(f"  already on every node: whole playbook (wall)       {again['wall']:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
