"""The PyTorch sample (`pyt_ddp_tiny`) on the lab: how its image reaches the workers, and the job's overhead beside
its training.

Run on the lab (`slurm-multi lab up --nodes 8` for 8 nodes):

    python -m benchmarks.image.pytorch_bench [--nodes 3 8] [--mode push]

For each node count: the lab's PyTorch base on node1 only (slurm_multi/lab/pytorch.py), the model's image and the
base removed from every other node and the image's entry from the shared tar cache, then one `slurm-multi submit
--nodes N --tags pyt_ddp_tiny --wait`. Printed from the job's record and files: the image's tar in the shared cache
(size), rank 0's publish, the slowest worker's load, the training (the longest container run, from the model's
start to its exit) and the overhead (the job's own time in SLURM, StartTime to EndTime, minus the training).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import entry_key, user_cache_dir
from benchmarks.e2e_bench import BIN, job_elapsed, on
from slurm_multi.lab.pytorch import ensure_pytorch_base, remove_pytorch_base

# group_vars' image_cache_dir (the jobs here set none).
CACHE = Path(user_cache_dir("/tmp/slurm-multi-image-cache-%u"))

MODEL = "pyt_ddp_tiny"


def forget_on_workers(nodes: list) -> None:
    """The workers hold neither the model's image nor its base: the whole image must reach them."""
    for node in nodes[1:]:
        images = on(node, "docker", "images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
        doomed = [image for image in images if image.startswith(f"ci-{MODEL}")]
        if doomed:
            on(node, "docker", "rmi", "-f", *doomed, check=False)
    remove_pytorch_base(nodes[1:])


def forget_in_cache() -> None:
    """Rank 0 publishes the image anew: the cache loses the entry of node1's image of the model, if it has one."""
    listed = on("node1", "docker", "images", "--format", "{{.Repository}} {{.ID}}", "--no-trunc", check=False)
    for repository, image_id in (line.split() for line in listed.stdout.splitlines()):
        if repository.startswith(f"ci-{MODEL}"):
            for suffix in (".tar", ".json"):
                (CACHE / f"{entry_key(image_id)}{suffix}").unlink(missing_ok=True)


def run_once(count: int, mode: str, work: Path) -> dict:
    nodes = [f"node{i}" for i in range(1, count + 1)]
    ensure_pytorch_base(["node1"])
    forget_on_workers(nodes)
    forget_in_cache()
    results = work / f"results-{count}-{time.monotonic_ns()}"
    started = time.perf_counter()
    out = subprocess.run(
        [str(BIN / "slurm-multi"), "submit", "--nodes", str(count), "--nodelist", f"node[1-{count}]"]
        + ["--mode", mode, "--no-exclusive", "--tags", MODEL, "--results-dir", str(results), "--wait"],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-2000:])
    (job,) = [p for p in results.iterdir() if p.is_dir() and p.name != "records"]
    record = json.loads((results / "records" / f"{job.name}.json").read_text())
    timeline = record["timeline"]

    def seconds(node, step):
        span = timeline.get(node, {}).get(step)
        return span["end"] - span["start"] if span else 0.0

    manifest = json.loads((job / "attempt-0" / "build_manifest.json").read_text())
    (entry,) = manifest["built_images"].values()
    tar = CACHE / f"{entry_key(entry['image_id'])}.tar"
    training = max(seconds(node, "run") for node in nodes)
    return {
        "nodes": count,
        "wall": wall,
        "tar_gb": tar.stat().st_size / 1e9 if tar.is_file() else float("nan"),
        "publish": seconds("node1", "publish"),
        "slowest_load": max(seconds(node, "load") for node in nodes[1:]),
        "training": training,
        "overhead": job_elapsed(job.name) - training,
        "tokens_per_sec": record["rows"][0]["performance"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--mode", choices=("push", "pull"), default="push")
    args = parser.parse_args()
    work = Path("/tmp/slurm-multi-pytorch-bench")
    work.mkdir(exist_ok=True)
    for count in args.nodes:
        figures = run_once(count, args.mode, work)
        print(
            f"{figures['nodes']} nodes ({args.mode}): image tar {figures['tar_gb']:.2f} GB, publish "
            f"{figures['publish']:.1f} s, slowest load {figures['slowest_load']:.1f} s; training "
            f"{figures['training']:.1f} s ({figures['tokens_per_sec']} tokens/sec), overhead "
            f"{figures['overhead']:.1f} s (submit to verdict {figures['wall']:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
