"""End-to-end time of a run on the lab: slurm-multi (push and pull mode) vs a plain bash sbatch script.

Run on the lab cluster (`slurm-multi lab up --nodes N`):

    python -m benchmarks.e2e_bench [--sizes 0,200] [--repeat 3] [--nodes 3] [--scenarios warm,cold]
    python -m benchmarks.e2e_bench --sweep 1,2,4,8 --sizes 0 --scenarios warm --no-plain   # lab up --nodes 8
    python -m benchmarks.e2e_bench --sizes 0 --scenarios warm --runtime docker,charliecloud --repeat 3

For a 2 MB image (the sample `dummy_lastrank`) and a 200 MB one (the same model plus a 200 MB layer), each variant
ends with the perf row. Scenarios: `cold`, the image built on node1 only (workers lack it); `warm`, the image
already on every node (slurm-multi's own image too, from a first run). Variants, taking turns in each repeat:

* slurm-multi push / pull: `slurm-multi submit --nodes N --mode push|pull --tags ... --wait`;
* plain bash: one sbatch script: `docker save` (the image is on node1) to the shared disk, `docker load` on the
  other nodes in parallel, `docker run` on all nodes at once with srun, grep the performance line, write a CSV.

`--runtime docker,charliecloud` runs each mode under both runtimes in the same turns. Under charliecloud the job is
submitted as a user of a site without Docker (tests/support/users/no_docker.py: no docker group, no docker command,
no daemon reachable) from a venv of this checkout that user can run (tests/support/users/user_venv.py), with
`-e container_runtime=charliecloud` and the lab's site settings (`charliecloud_bases`: the lab's bases as tars).
Warm there means the squashfs already built, published in the shared cache and ready on every node (a first run).
Charliecloud has no cold scenario of its own: its image is one shared file, not a copy on each node.

Each run is timed from submit to verdict (both poll SLURM, which rounds up to its polling steps) and as the job's
own run time in SLURM (StartTime to EndTime, whole seconds), split into the containers' own time (the longest
container, from the model's start to its exit) and everything else (Ansible, image distribution, collection): the
overhead. SLURM's whole seconds hide a cut smaller than a second: for slurm-multi the ansible-playbook's own span
(from its process start to its last event, 10 ms steps) and the overhead within it are printed too. For
slurm-multi the CPU seconds of the batch host's Ansible processes (the pipeline's ansible-playbook
with the workers it forks in push mode; in pull mode rank 0's own ansible-playbook plus the collect playbook; the
task_profile callback in benchmarks/callback_plugins reads them) are reported too, and for every variant the
machine's CPU from submit to verdict (/proc/stat: the lab's nodes share the machine's cores, so this is all the run
cost, its nodes' own work included).
"""

import argparse
import configparser
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_multi.lab import cluster as lab
from tests.support.users.local_users import NODOCKER, setpriv_argv
from tests.support.users.no_docker import assert_no_docker_reachable, ensure_nodocker_user, no_docker_path
from tests.support.users.user_venv import ensure_user_venv

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CALLBACKS = Path(__file__).resolve().parent / "callback_plugins"

PLAIN_SCRIPT = """#!/bin/bash
set -e
cd {zoo}
docker save -o {work}/image.tar {tag}
for node in {workers}; do srun --overlap -N1 -n1 -w $node docker load -q -i {work}/image.tar >/dev/null & done
wait
srun --overlap -N{nodes} --ntasks-per-node=1 sh -c 'start=$(date +%s.%N); docker run --init --network=host \\
  -e MASTER_ADDR=127.0.0.11 -e MASTER_PORT=29500 -e NNODES={nodes} -e NODE_RANK=$SLURM_NODEID \\
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


def lab_nodes(count: int) -> list:
    return [f"node{i}" for i in range(1, count + 1)]


def forget_on_workers(tag: str, nodes: list):
    for node in nodes[1:]:
        on(node, "docker", "rmi", "-f", tag, check=False)


def forget_slurm_multi_images_on_workers(nodes: list):
    """slurm-multi's own image (its name and fingerprint label) must reach the workers anew (the cold scenario)."""
    for node in nodes[1:]:
        ids = on(node, "docker", "images", "-q", "--filter", "label=slurm-multi.build-fingerprint", check=False)
        if ids.stdout.split():
            on(node, "docker", "rmi", "-f", *ids.stdout.split(), check=False)


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


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent so far (/proc/stat): every lab node, daemon and client shares its cores,
    so a run's delta is all it cost - the nodes' own work included, which bounds its wall time on the lab's cores."""
    busy = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, busy[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def container_seconds(starts_ends) -> float:
    return max(end - start for start, end in starts_ends)


def batch_host_cpu(profile: Path, batch_host: str) -> float:
    """CPU seconds of the batch host's ansible-playbook processes, from the task_profile callback's events.

    Each ansible-playbook reports its own and its waited-for children's CPU at its last event. In pull mode every
    node's playbook writes to the same file; the batch host's is the one whose tasks ran on `batch_host`, plus
    the collect playbook (the localhost play).
    """
    last, hosts = {}, {}
    for line in profile.read_text().splitlines():
        event = json.loads(line)
        last[event["pid"]] = event["cpu"]
        if event["event"] == "result":
            hosts.setdefault(event["pid"], set()).add(event["host"])
    return sum(
        cpu for pid, cpu in last.items() if batch_host in hosts.get(pid, ()) or "localhost" in hosts.get(pid, ())
    )


def playbook_span(profile: Path) -> float:
    """Seconds from the first ansible-playbook's process start to the last one's end (task_profile's events, 10 ms
    steps): in push mode the pipeline's one playbook, in pull mode every node's and the collect. SLURM's job time is
    whole seconds; this tells a before from an after that differ by less."""
    events = [json.loads(line) for line in profile.read_text().splitlines()]
    starts = [e["process_start"] for e in events if e["event"] == "playbook" and "process_start" in e]
    return max(e["t"] for e in events) - min(starts)


def profiled_env(checkout: Path, profile: Path, base=None) -> dict:
    """The environment (``base``, else this process's) that adds the task_profile callback to the checkout's own
    (its ansible.cfg's): Ansible's variables replace the file's lists, so both lists are given whole."""
    config = configparser.ConfigParser()
    config.read(checkout / "ansible.cfg")
    enabled = [name.strip() for name in config.get("defaults", "callbacks_enabled", fallback="").split(",")]
    return dict(
        os.environ if base is None else base,
        ANSIBLE_CALLBACK_PLUGINS=f"{CALLBACKS}:{checkout / 'plugins' / 'callback'}",
        ANSIBLE_CALLBACKS_ENABLED=",".join(["task_profile", *filter(None, enabled)]),
        TASK_PROFILE_FILE=str(profile),
    )


class NoDockerUser:
    """The user charliecloud's jobs are submitted as: NODOCKER, a venv of this checkout it can run, a PATH with no
    docker command, and the lab's site settings for ``nodes`` as this checkout writes them."""

    def __init__(self, work: Path, nodes: list):
        ensure_nodocker_user()
        self.venv = ensure_user_venv()
        self.path = no_docker_path(self.venv)
        assert_no_docker_reachable(self.path)
        self.site_config = work / "site.yml"
        self.site_config.write_text(lab._site_config(lab.lab_nodes(len(nodes))))

    def owned(self, path: Path, directory: bool) -> Path:
        """``path`` made (a dir, or an empty file) and given to the user, who writes into it."""
        path.mkdir() if directory else path.touch()
        shutil.chown(path, NODOCKER)
        return path

    def environment(self) -> dict:
        return {"PATH": self.path, "LANG": "C.UTF-8", "SLURM_MULTI_SITE_CONFIG": str(self.site_config)}


def run_slurm_multi(
    zoo: Path, card: dict, work: Path, mode: str, nodes: list, checkout: Path = ROOT, user: NoDockerUser = None
) -> dict:
    """One job by `slurm-multi submit` of `checkout` (its own venv's, for another checkout than this one); with
    ``user``, under charliecloud, submitted as that user."""
    results = work / f"results-{time.monotonic_ns()}"
    profile = work / f"profile-{time.monotonic_ns()}.jsonl"
    env = profiled_env(checkout, profile)
    command = str((BIN if checkout == ROOT else checkout / ".venv" / "bin") / "slurm-multi")
    runtime_args, cwd = [], None
    if user is not None:
        user.owned(results, directory=True)
        user.owned(profile, directory=False)
        env = profiled_env(checkout, profile, base=user.environment())
        command, runtime_args, cwd = (
            str(user.venv / "bin" / "slurm-multi"),
            ["-e", "container_runtime=charliecloud"],
            work,
        )
    start, cpu_before = time.perf_counter(), machine_cpu()
    argv = [
        command,
        "submit",
        "--nodes",
        str(len(nodes)),
        # These nodes, whatever else the lab runs: node1 holds the image the runs start from.
        "--nodelist",
        ",".join(nodes),
        "--mode",
        mode,
        "--no-exclusive",
        "--tags",
        card["name"],
        "--models-file",
        str(zoo / "models.json"),
        "--results-dir",
        str(results),
        *runtime_args,
        "--wait",
    ]
    out = subprocess.run(
        argv if user is None else setpriv_argv(NODOCKER, argv), capture_output=True, text=True, env=env, cwd=cwd
    )
    wall, machine = time.perf_counter() - start, machine_cpu() - cpu_before
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-2000:])
    (job,) = [p for p in results.iterdir() if p.is_dir() and p.name != "records"]
    nodes_dir = job / "attempt-0" / "nodes"
    statuses = [json.loads((nodes_dir / n / "status.json").read_text()) for n in nodes]
    return {
        "wall": wall,
        "job": job_elapsed(job.name),
        "containers": container_seconds((s["started_at"], s["ended_at"]) for s in statuses),
        "cpu": batch_host_cpu(profile, nodes[0]),
        "playbook": playbook_span(profile),
        "machine_cpu": machine,
    }


def run_plain(zoo: Path, card: dict, tag: str, work: Path, nodes: list) -> dict:
    plain = work / f"plain-{time.monotonic_ns()}"
    plain.mkdir()
    script = plain / "job.sh"
    script.write_text(PLAIN_SCRIPT.format(zoo=zoo, tag=tag, work=plain, nodes=len(nodes), workers=" ".join(nodes[1:])))
    start, cpu_before = time.perf_counter(), machine_cpu()
    job_id = (
        subprocess.run(
            ["sbatch", "--parsable", "-N", str(len(nodes)), "-w", ",".join(nodes), "--wait"]
            + ["-o", str(plain / "out"), str(script)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    wall, machine = time.perf_counter() - start, machine_cpu() - cpu_before
    assert "tokens/sec" in (plain / "perf.csv").read_text(), (plain / "out").read_text()
    times = [tuple(map(float, (plain / f"time{i}").read_text().split())) for i in range(len(nodes))]
    return {"wall": wall, "job": job_elapsed(job_id), "containers": container_seconds(times), "machine_cpu": machine}


def bench(
    payload_mb: int,
    repeat: int,
    nodes: list,
    scenario: str,
    modes: list,
    plain: bool,
    before: Path = None,
    runtimes: tuple = ("docker",),
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-", dir="/tmp"))
    try:
        # The no-Docker user reads the zoo and writes its results and profile here.
        work.chmod(0o755)
        user = NoDockerUser(work, nodes) if "charliecloud" in runtimes else None
        zoo, card = make_zoo(work, payload_mb)
        tag = f"bench-e2e/{card['name']}:latest"
        # Build once on node1 so that every variant starts from a warm build cache and the same image.
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
        # Each variant: its name and how it runs; an earlier checkout's slurm-multi runs beside this one's.
        variants = []
        if "docker" in runtimes:
            variants += [(f"slurm-multi {mode}", mode, ROOT, None) for mode in modes]
        if "charliecloud" in runtimes:
            variants += [(f"charliecloud {mode}", mode, ROOT, user) for mode in modes]
        if before:
            variants += [(f"before: {mode}", mode, before, None) for mode in modes]
        samples = {name: [] for name in [v[0] for v in variants] + (["plain bash"] if plain else [])}
        if scenario == "warm":  # every node holds each checkout's and runtime's image before the measured runs
            for checkout, runner in dict.fromkeys((variant[2], variant[3]) for variant in variants):
                run_slurm_multi(zoo, card, work, modes[0], nodes, checkout, runner)
        for _ in range(repeat):
            if plain:
                if scenario == "cold":
                    forget_on_workers(tag, nodes)
                samples["plain bash"].append(run_plain(zoo, card, tag, work, nodes))
            for name, mode, checkout, runner in variants:
                if scenario == "cold":
                    forget_slurm_multi_images_on_workers(nodes)
                samples[name].append(run_slurm_multi(zoo, card, work, mode, nodes, checkout, runner))
        forget_on_workers(tag, nodes)
        return samples
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(label: str, samples: dict) -> None:
    med = statistics.median
    print(label)
    for name, runs in samples.items():
        wall, job, containers = (med(r[k] for r in runs) for k in ("wall", "job", "containers"))
        overheads = sorted(r["job"] - r["containers"] for r in runs)
        figures = ""
        if "playbook" in runs[0]:
            in_playbook = sorted(r["playbook"] - r["containers"] for r in runs)
            figures += (
                f"; ansible-playbook {med(r['playbook'] for r in runs):5.2f} s, overhead in it "
                f"{med(in_playbook):4.2f} s ({in_playbook[0]:.2f}-{in_playbook[-1]:.2f})"
            )
        if "cpu" in runs[0]:
            figures += f"; batch host CPU {med(r['cpu'] for r in runs):4.1f} s"
        figures += f"; machine CPU {med(r['machine_cpu'] for r in runs):4.1f} s"
        print(
            f"  {name:<17} submit-to-verdict {wall:5.1f} s; the job itself {job:5.1f} s = containers "
            f"{containers:4.1f} s + overhead {med(overheads):5.1f} s (range {overheads[0]:.1f}-{overheads[-1]:.1f})"
            f"{figures}"
        )
    if "plain bash" in samples:
        for name in samples:
            if name != "plain bash":
                ratio = med(r["job"] for r in samples[name]) / med(r["job"] for r in samples["plain bash"])
                print(f"  {name} / plain bash (the job itself): {ratio:.2f}x")
    for name in samples:
        docker = name.replace("charliecloud ", "slurm-multi ", 1)
        if name.startswith("charliecloud ") and docker in samples:
            ours, theirs = (med(r["job"] - r["containers"] for r in samples[n]) for n in (name, docker))
            within = ""
            if "playbook" in samples[name][0]:
                ours_in, theirs_in = (med(r["playbook"] - r["containers"] for r in samples[n]) for n in (name, docker))
                within = f"; within ansible-playbook {ours_in - theirs_in:+.2f} s ({ours_in / theirs_in:.2f}x)"
            print(f"  {name} beside {docker}, overhead: {ours - theirs:+.1f} s{within}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--sizes", default="0,200", help="payload MB per image variant (0: the 2 MB sample image)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--sweep", help="node counts to run one after another, e.g. 1,2,4,8 (overrides --nodes)")
    parser.add_argument("--scenarios", default="warm,cold")
    parser.add_argument("--modes", default="push,pull")
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain bash script")
    parser.add_argument(
        "--runtime",
        default="docker",
        help="container runtimes to run each mode under, in turns: docker, charliecloud or docker,charliecloud",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="an earlier checkout (a git worktree with its own .venv) whose slurm-multi runs beside this one, in turns",
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.sweep.split(",")] if args.sweep else [args.nodes]
    modes = args.modes.split(",")
    runtimes = tuple(args.runtime.split(","))
    unknown = sorted(set(runtimes) - {"docker", "charliecloud"})
    if unknown:
        parser.error(f"--runtime {','.join(unknown)}: the choices are docker and charliecloud")
    if "charliecloud" in runtimes and "cold" in args.scenarios.split(","):
        parser.error(
            "--scenarios cold puts the image on node1 only, which is Docker's; charliecloud's image is one shared "
            "file: use --scenarios warm with --runtime charliecloud"
        )
    for count in counts:
        for payload in (int(s) for s in args.sizes.split(",")):
            for scenario in args.scenarios.split(","):
                samples = bench(
                    payload, args.repeat, lab_nodes(count), scenario, modes, not args.no_plain, args.before, runtimes
                )
                where = "already on every node" if scenario == "warm" else "on node1 only"
                label = f"{2 + payload} MB image, {count} node(s), {scenario} ({where}), {args.repeat} run(s) (medians)"
                report(label, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
