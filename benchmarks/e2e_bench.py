"""End-to-end wall time of a 3-node run on the lab: slurm-multi vs a plain bash sbatch script doing the same steps.

Run on the lab cluster (`slurm-multi lab up`): python benchmarks/e2e_bench.py [--repeat 1]

For a 2 MB image (the sample `dummy_lastrank`) and a 200 MB one (the same model plus a 200 MB layer), each variant
starts with the image built on node1 only (workers lack it, the tar cache is empty) and ends with the perf row:

* slurm-multi: `slurm-multi submit --nodes 3 --tags ... --wait` (the whole pipeline, its afterany collect job too);
* plain bash: one sbatch script: `docker save` (the image is on node1) to the shared disk, `docker load` on node2
  and node3 in parallel, `docker run` on all nodes at once with srun, grep the performance line, write a CSV.

Each run is timed from submit to verdict (both poll SLURM, which rounds up to its polling steps) and as the job's
own run time in SLURM (StartTime to EndTime), split into the containers' own time (the longest container, from the
model's start to its exit) and everything else (Ansible, image distribution, collection): the overhead.
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

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NODES = ("node1", "node2", "node3")

PLAIN_SCRIPT = """#!/bin/bash
set -e
cd {zoo}
docker save -o {work}/image.tar {tag}
srun --overlap -N1 -n1 -w node2 docker load -q -i {work}/image.tar >/dev/null &
srun --overlap -N1 -n1 -w node3 docker load -q -i {work}/image.tar >/dev/null &
wait
srun --overlap -N3 --ntasks-per-node=1 sh -c 'start=$(date +%s.%N); docker run --init --network=host \\
  -e MASTER_ADDR=127.0.0.11 -e MASTER_PORT=29500 -e NNODES=3 -e NODE_RANK=$SLURM_NODEID \\
  -v {zoo}/scripts/dummy:/myworkspace -w /myworkspace --name plain-$SLURM_JOB_ID-$SLURM_NODEID {tag} \\
  sh run_lastrank.sh > {work}/rank$SLURM_NODEID.log 2>&1; echo "$start $(date +%s.%N)" > {work}/time$SLURM_NODEID; \\
  docker rm plain-$SLURM_JOB_ID-$SLURM_NODEID >/dev/null'
echo "model,performance,metric" > {work}/perf.csv
grep -h '^performance:' {work}/rank*.log | awk '{{print "dummy_lastrank," $2 "," $3}}' >> {work}/perf.csv
"""


def on(node, *argv, check=True):
    return subprocess.run(["srun", "-N1", "-w", node, "--quiet", *argv], check=check, capture_output=True, text=True)


def make_zoo(work: Path, payload_mb: int) -> tuple:
    """A copy of the sample zoo; for a payload, a Dockerfile adding that many MB of random bytes."""
    zoo = work / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    cards = json.loads((zoo / "models.json").read_text())
    card = next(c for c in cards if c["name"] == "dummy_lastrank")
    if payload_mb:
        with open(zoo / "docker" / "payload.bin", "wb") as handle:
            for _ in range(payload_mb):
                handle.write(os.urandom(1 << 20))
        (zoo / "docker" / "big.Dockerfile").write_text(
            (zoo / "docker" / "dummy.Dockerfile").read_text() + "COPY payload.bin /payload.bin\n"
        )
        card = dict(card, name="dummy_lastrank_big", dockerfile="docker/big")
        (zoo / "models.json").write_text(json.dumps(cards + [card]))
    return zoo, card


def forget_on_workers(tag: str):
    for node in ("node2", "node3"):
        on(node, "docker", "rmi", "-f", tag, check=False)


def job_elapsed(job_id: str) -> float:
    """The job's own run time as SLURM recorded it (StartTime to EndTime, whole seconds): no polling delay."""
    from datetime import datetime

    fields = dict(
        f.split("=", 1)
        for f in subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], check=True, capture_output=True, text=True
        ).stdout.split()
        if "=" in f
    )
    start, end = (datetime.fromisoformat(fields[k]) for k in ("StartTime", "EndTime"))
    return (end - start).total_seconds()


def container_seconds(starts_ends) -> float:
    return max(end - start for start, end in starts_ends)


def run_slurm_multi(zoo: Path, card: dict, work: Path) -> dict:
    results = work / f"results-{time.monotonic_ns()}"
    env = dict(os.environ)
    start = time.perf_counter()
    out = subprocess.run(
        [
            str(BIN / "slurm-multi"),
            "submit",
            "--nodes",
            "3",
            "--no-exclusive",
            "--tags",
            card["name"],
            "--models-file",
            str(zoo / "models.json"),
            "--results-dir",
            str(results),
            "--wait",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-2000:])
    (job,) = [p for p in results.iterdir() if p.is_dir() and p.name != "records"]
    statuses = [json.loads((job / "nodes" / n / "status.json").read_text()) for n in NODES]
    return {
        "wall": wall,
        "job": job_elapsed(job.name),
        "containers": container_seconds((s["started_at"], s["ended_at"]) for s in statuses),
    }


def run_plain(zoo: Path, card: dict, tag: str, work: Path) -> dict:
    plain = work / f"plain-{time.monotonic_ns()}"
    plain.mkdir()
    script = plain / "job.sh"
    script.write_text(PLAIN_SCRIPT.format(zoo=zoo, tag=tag, work=plain))
    start = time.perf_counter()
    job_id = (
        subprocess.run(
            ["sbatch", "--parsable", "-N", "3", "--wait", "-o", str(plain / "out"), str(script)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    wall = time.perf_counter() - start
    assert "tokens/sec" in (plain / "perf.csv").read_text(), (plain / "out").read_text()
    times = [tuple(map(float, (plain / f"time{i}").read_text().split())) for i in range(3)]
    return {"wall": wall, "job": job_elapsed(job_id), "containers": container_seconds(times)}


def bench(payload_mb: int, repeat: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-", dir="/tmp"))
    try:
        zoo, card = make_zoo(work, payload_mb)
        tag = f"bench-e2e/{card['name']}:latest"
        # Build once on node1 so that both variants start from a warm build cache and the same image.
        on(
            "node1",
            "docker",
            "build",
            "-q",
            "--network=host",
            "-t",
            tag,
            "-f",
            str(zoo / (card["dockerfile"] + ".Dockerfile")),
            str(zoo / "docker"),
        )
        samples = {"slurm-multi": [], "plain bash": []}
        for _ in range(repeat):
            forget_on_workers(tag)
            samples["plain bash"].append(run_plain(zoo, card, tag, work))
            # slurm-multi's own image (its name and fingerprint label) must reach the workers anew, too.
            for node in ("node2", "node3"):
                ids = on(
                    node, "docker", "images", "-q", "--filter", "label=slurm-multi.build-fingerprint", check=False
                ).stdout.split()
                if ids:
                    on(node, "docker", "rmi", "-f", *ids, check=False)
            samples["slurm-multi"].append(run_slurm_multi(zoo, card, work))
        forget_on_workers(tag)
        return samples
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--sizes", default="0,200", help="payload MB per image variant (0: the 2 MB sample image)")
    args = parser.parse_args()
    med = statistics.median
    for payload in (int(s) for s in args.sizes.split(",")):
        samples = bench(payload, args.repeat)
        label = f"{2 + payload} MB image"
        print(f"{label}, 3 nodes, {args.repeat} run(s) each (medians)")
        for name, runs in samples.items():
            wall, job, containers = (med(r[k] for r in runs) for k in ("wall", "job", "containers"))
            print(
                f"  {name:<12} submit-to-verdict {wall:5.1f} s; the job itself {job:5.1f} s = containers "
                f"{containers:4.1f} s + overhead {job - containers:5.1f} s"
            )
        ratio = med(r["job"] for r in samples["slurm-multi"]) / med(r["job"] for r in samples["plain bash"])
        print(f"  slurm-multi / plain bash (the job itself): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
