"""Docker's CLI against the Docker SDK for Python, for the calls a job makes on its nodes (issue 30, item 7).

Run on the lab, as root, with the SDK installed (the `bench` extra: pip install -e '.[bench]'):

    python -m benchmarks.image.docker_client_bench [--repeat 40]

1. Counts the docker CLI calls of one real job per mode (the dummy model on node[1-3]): a `docker` first on PATH logs
   each call's subcommand, never its arguments, and runs the real CLI.
2. Times on node1's daemon socket, side by side and in turn, the calls a job makes most (`image inspect`, `ps`)
   through the CLI (one process per call, as module_utils/docker_cli.py runs it) and through the SDK (one client,
   reused), and the SDK's import, which every module process that used it would pay once (each task's module is a
   new Python process).
Prints the figures and what the SDK would take off a job: its calls times the per-call saving, less one import per
module run that calls docker.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.pipeline import ansible_env, run_pipeline

# Logs the subcommand (the first two words that are neither an option nor its value) and runs the real CLI.
WRAPPER = """#!/bin/sh
set -- "$@"
words=""
skip=0
for word in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$word" in --host|-H|--format|-f|--filter|--label|--name) skip=1; continue;; -*) continue;; esac
  words="$words $word"
  case "$words" in *" "*" "*) break;; esac
done
echo "$PPID$words" >> "$DOCKER_CALL_LOG"
exec {docker} "$@"
"""


def count_calls(mode: str, work: Path) -> dict:
    """{subcommand: calls} of one pipeline run in `mode`, and the module processes that made them."""
    bin_dir = work / f"bin-{mode}"
    bin_dir.mkdir()
    real = subprocess.run(["sh", "-c", "command -v docker"], capture_output=True, text=True, check=True).stdout
    wrapper = bin_dir / "docker"
    wrapper.write_text(WRAPPER.format(docker=real.strip()))
    wrapper.chmod(0o755)
    log = work / f"calls-{mode}.log"
    env = dict(ansible_env(), PATH=f"{bin_dir}:{os.environ['PATH']}", DOCKER_CALL_LOG=str(log))
    run = run_pipeline(
        work / f"results-{mode}",
        mode=mode,
        nodelist="node[1-3]",
        env=env,
        model_tags=["dummy"],
        srun_extra_env=["DOCKER_CALL_LOG"],  # push mode's srun steps see an allowlist of the environment
    )
    if run.rc != 0:
        raise SystemExit(f"the {mode} job failed: {run.output[-2000:]}")
    lines = log.read_text().split("\n") if log.exists() else []
    calls = collections.Counter(" ".join(line.split()[1:]) for line in lines if line.strip())
    callers = {line.split()[0] for line in lines if line.strip()}
    return {"calls": dict(calls.most_common()), "total": sum(calls.values()), "processes": len(callers)}


def per_call_ms(action, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def import_ms(statement: str, repeat: int) -> float:
    return per_call_ms(lambda: subprocess.run([sys.executable, "-c", statement], check=True), repeat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    import docker  # the SDK: the bench extra

    host = node_docker_host("node1")
    image = subprocess.run(
        ["docker", "--host", host, "images", "-q"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    client = docker.DockerClient(base_url=host)

    def cli(*words):
        subprocess.run(["docker", "--host", host, *words], capture_output=True, check=True)

    figures = {}
    for _ in range(2):  # in turn, twice: the second round's figures stand
        figures = {
            "cli image inspect": per_call_ms(lambda: cli("image", "inspect", image), args.repeat),
            "sdk image inspect": per_call_ms(lambda: client.api.inspect_image(image), args.repeat),
            "cli ps": per_call_ms(lambda: cli("ps", "-q"), args.repeat),
            "sdk ps": per_call_ms(lambda: client.api.containers(quiet=True), args.repeat),
            "python start": import_ms("pass", args.repeat // 4),
            "python start + import docker": import_ms("import docker", args.repeat // 4),
        }
    sdk_import = figures["python start + import docker"] - figures["python start"]
    saving = statistics.mean(
        [figures["cli image inspect"] - figures["sdk image inspect"], figures["cli ps"] - figures["sdk ps"]]
    )
    with tempfile.TemporaryDirectory(prefix="docker-client-bench-") as work:
        counts = {mode: count_calls(mode, Path(work)) for mode in ("push", "pull")}
    print(json.dumps({"ms": {k: round(v, 1) for k, v in figures.items()}, "jobs": counts}, indent=2))
    print(f"\nthe SDK's import: {sdk_import:.0f} ms per process; a call's saving: {saving:.1f} ms")
    for mode, job in counts.items():
        taken, added = job["total"] * saving, job["processes"] * sdk_import
        print(
            f"{mode}: {job['total']} docker calls in {job['processes']} processes on 3 nodes; the SDK would take "
            f"{taken:.0f} ms of CLI time off and add {added:.0f} ms of imports: {added - taken:+.0f} ms a job"
        )


if __name__ == "__main__":
    main()
