"""The controller side of run_multi.yml at 1 to 256 nodes, simulated on this one machine (issue 16).

Run anywhere (no lab cluster, no SLURM allocation, no Docker daemon needed):
    python -m benchmarks.scale_bench [--nodes 1,8,32,64,128,256] [--pull-nodes 1,64,256] [--repeat 1]

Push mode: one `ansible-playbook playbooks/run_multi.yml -f N --check` drives N inventory hosts. The real
slurm_allocation inventory reads a faked allocation (SLURM_JOB_NODELIST=sim[001-N], SLURM_JOB_NUM_NODES, SLURM_JOB_ID,
MASTER_ADDR=127.0.0.1, SLURM_MULTI_JOB_END=NONE and SLURM_MULTI_JOB_START in place of squeue), every host uses
the local connection, and the real tasks run in check mode, so each module starts, parses its arguments and plans,
but writes nothing, the barrier returns at once and run_model starts no container. What stands in for the nodes:

* the `docker` CLI the modules call is a stub on PATH that answers only the read-only calls check mode makes
  (`version`, `ps`, `image inspect`: the image is on every node, the warm path) and refuses anything else;
* a build manifest is put where rank 0's build stage expects it (check mode writes none; build_images then
  reuses the image, as in a warm run);
* `postprocessing_fail_on_failure=false`: nothing ran, so the verdict is FAILURE, which is expected here.

Measured per task, from benchmarks/callback_plugins/task_profile.py's events: wall time (task start to the next
task's start) and the CPU seconds of the ansible-playbook process tree. On a cluster the modules run on the nodes,
so each module process's own CPU (timed by a wrapper interpreter with GNU time) is subtracted: "controller CPU" is
what the batch host spends (its forks, templating, result handling), "module CPU" what ran on the simulated nodes.
Wall time here includes the modules competing for this machine's cores, so it is an upper bound for the
controller's own latency. Also: the whole run's wall and CPU, the peak RSS of the ansible-playbook main process
and the peak summed PSS of it and its forked workers.

Pull mode: one node's own `ansible-playbook run_multi.yml --limit <node> -e mode=pull` (as the pull step starts
it: SLURMD_NODENAME, MAD_BARRIER_TOKEN in the environment, the local connection), for rank 0 and for one worker,
with the allocation of N nodes in the inventory; and the batch host's `collect.yml` over the N nodes.
"""

import argparse
import bisect
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.e2e_bench import profiled_env

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PLAYBOOKS = ROOT / "playbooks"
JOB_ID = "990001"
IMAGE_ID = "sha256:" + "5c" * 32
GROUPS = None  # the CpuGroups of this run of the script (main)

# Each simulated node's docker CLI: only what check mode reads; a write would be refused and fail the task.
DOCKER_STUB = """#!/bin/sh
case "$1 $2" in
  "version "*) echo 20.10.24 ;;
  "info "*) echo /tmp ;;
  "ps "*) ;;
  "image inspect") exec cat "$SCALE_BENCH_IMAGE_JSON" ;;
  *) echo "scale_bench's docker stub refuses a call check mode should not make: docker $*" >&2; exit 97 ;;
esac
"""

# The interpreter every module runs under: the real one, moved first into the cgroup that counts the nodes' CPU.
INTERPRETER_WRAPPER = """#!/bin/sh
echo $$ > "$SCALE_BENCH_MODULE_CGROUP/cgroup.procs" && exec {python} "$@"
"""


class CpuGroups:
    """Two CPU-accounting cgroups: the controller (ansible-playbook and its forks) and the simulated nodes' modules.

    A cgroup counts CPU as it is spent; getrusage counts a child only once it is reaped, and Ansible reaps a task's
    workers only when it reuses their slots, tasks later. Sampled every 50 ms, so each task gets its own seconds.
    """

    def __init__(self):
        if Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").exists():
            base, self._file, self._scale = Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage", 1e-9
        elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, self._file, self._scale = Path("/sys/fs/cgroup"), "cpu.stat", 1e-6
        else:
            raise SystemExit("scale_bench needs cgroup CPU accounting (v1 cpuacct or v2) at /sys/fs/cgroup")
        self.root = base / f"scale_bench_{os.getpid()}"
        self.controller, self.modules = self.root / "controller", self.root / "modules"
        try:
            for path in (self.root, self.controller, self.modules):
                path.mkdir()
        except OSError as exc:
            raise SystemExit(
                f"scale_bench cannot make its accounting cgroups under {base} (run as root): {exc}"
            ) from None
        self.samples = []
        self.main_pid = None
        self._stop = threading.Event()
        self._thread = None

    def _read(self, group: Path) -> float:
        text = (group / self._file).read_text()
        if self._file == "cpu.stat":
            text = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))
        return int(text) * self._scale

    def mark(self) -> None:
        """The zero of the next run's figures (before the process starts: preexec_fn and threads do not mix)."""
        self.main_pid, self.samples = None, []
        self.samples = [self.sample()]

    def sample(self) -> tuple:
        return time.time(), self._read(self.controller), self._read(self.modules), self._main_cpu()

    def _main_cpu(self) -> float:
        """The ansible-playbook main process's own CPU (not its workers'): the part of the controller that is serial."""
        if self.main_pid is None:
            return self.samples[-1][3] if self.samples else 0.0
        try:
            with open(f"/proc/{self.main_pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return self.samples[-1][3] if self.samples else 0.0

    def start(self) -> None:
        """Start sampling; the first sample is taken by the caller (mark), before it starts a process."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(self.sample())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def at(self, when: float) -> tuple:
        """(controller, modules, main process) CPU seconds since mark() at `when`, interpolated between samples."""
        base = self.samples[0]
        times = [sample[0] for sample in self.samples]
        index = min(max(bisect.bisect_left(times, when), 1), len(times) - 1)
        before, after = self.samples[index - 1], self.samples[index]
        share = 0.0 if after[0] <= before[0] else min(max((when - before[0]) / (after[0] - before[0]), 0.0), 1.0)
        return tuple(b + share * (a - b) - z for b, a, z in zip(before[1:], after[1:], base[1:], strict=True))

    def join_controller(self) -> None:
        """preexec_fn: the ansible-playbook about to start, and every process it forks, counts as the controller."""
        (self.controller / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for path in (self.modules, self.controller, self.root):
            try:
                path.rmdir()
            except OSError:
                pass


def nodelist(count: int) -> tuple:
    width = max(3, len(str(count)))
    names = [f"sim{i:0{width}d}" for i in range(1, count + 1)]
    expression = f"sim[{1:0{width}d}-{count:0{width}d}]" if count > 1 else names[0]
    return expression, names


class Workdir:
    """One run's temp dir: results dir, docker stub, timed interpreter, profile files."""

    def __init__(self, parent: Path, label: str):
        self.path = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=parent))
        self.results = self.path / "results"
        self.results.mkdir(mode=0o700)
        (self.path / "no-site.yml").touch()  # an empty site file: none of this machine's settings
        stub_bin = self.path / "bin"
        stub_bin.mkdir()
        (stub_bin / "docker").write_text(DOCKER_STUB)
        (stub_bin / "docker").chmod(0o755)
        self.interpreter = self.path / "python"
        self.interpreter.write_text(INTERPRETER_WRAPPER.format(python=sys.executable))
        self.interpreter.chmod(0o755)
        self.profile = self.path / "profile.jsonl"
        self.image_json = self.path / "image.json"
        self.stub_bin = stub_bin

    def env(self, nodes: int, extra=None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MAD_", "ANSIBLE_"))}
        expression, _ = nodelist(nodes)
        env.update(
            PATH=f"{self.stub_bin}:{BIN}:{env.get('PATH', '')}",
            SLURM_JOB_ID=JOB_ID,
            SLURM_JOB_NODELIST=expression,
            SLURM_JOB_NUM_NODES=str(nodes),
            MASTER_ADDR="127.0.0.1",
            SLURM_MULTI_JOB_END="NONE",
            # The job's start, as the job script exports it: with no slurmctld, squeue would time out instead.
            SLURM_MULTI_JOB_START="2026-01-01T00:00:00",
            SLURM_MULTI_RESULTS_DIR=str(self.results),
            SLURM_MULTI_SITE_CONFIG=str(self.path / "no-site.yml"),
            # The project's callbacks too (preload_plugins' compiled templates), as a user's run has them.
            **profiled_env(ROOT, self.profile, base={}),
            SCALE_BENCH_MODULE_CGROUP=str(GROUPS.modules),
            SCALE_BENCH_IMAGE_JSON=str(self.image_json),
        )
        env.update(extra or {})
        return env

    def seed_warm_image(self) -> None:
        """The manifest rank 0's build stage reads, and the image every node's daemon holds (the stub's answer)."""
        from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
            BuildOutcome,
            plan_image_builds,
            record_builds,
            with_base_images,
        )
        from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
            load_model_cards,
            select_model_cards,
            write_manifest,
        )
        from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import FINGERPRINT_LABEL
        from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import attempt_dir

        models = ROOT / "models" / "models.json"
        context = {"guest_os": "UBUNTU", "docker_build_arg": {}, "docker_env_vars": {}, "docker_mounts": {}}
        attempt = Path(attempt_dir(str(self.results), JOB_ID, 0))
        attempt.mkdir(parents=True, mode=0o700)
        cards = select_model_cards(load_model_cards(models), ["dummy"])
        (plan,) = plan_image_builds(models.parent, cards, context, attempt)
        # The stub answers every `image inspect` with IMAGE_ID, the base image's included.
        plan = with_base_images(plan, {reference: IMAGE_ID for reference in plan.base_references})
        outcome = BuildOutcome(plan, "reused", IMAGE_ID, 0.0, "scale_bench: the image is on every node")
        write_manifest(str(attempt / "build_manifest.json"), record_builds([outcome], context))
        inspected = {"Id": IMAGE_ID, "Size": 2_000_000, "Config": {"Labels": {FINGERPRINT_LABEL: plan.fingerprint}}}
        self.image_json.write_text(json.dumps([inspected]))
        self.image_name = plan.image_name


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _controller_pids(pgid: int) -> list:
    """The ansible-playbook process and its forked workers (not the module processes they start)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if b"ansible-playbook" in handle.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_playbook(argv: list, env: dict, timeout: float) -> dict:
    """Run one ansible-playbook in its own session and cgroup; its wall time, CPU, peak RSS and PSS."""
    started = time.time()
    GROUPS.mark()
    with open(Path(env["TASK_PROFILE_FILE"]).with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=GROUPS.join_controller,
        )
    GROUPS.main_pid = proc.pid
    GROUPS.start()
    peak_main, peak_pss, polls = 0, 0, 0
    try:
        while proc.poll() is None:
            if time.time() - started > timeout:
                raise TimeoutError(
                    f"{Path(argv[1]).name} with {env['SLURM_JOB_NUM_NODES']} hosts outlived {timeout:.0f} s"
                )
            peak_main = max(peak_main, _hwm_kb(proc.pid))
            if polls % 4 == 0:  # summing PSS over hundreds of workers costs CPU: every second only
                peak_pss = max(peak_pss, sum(_pss_kb(pid) for pid in _controller_pids(proc.pid)))
            polls += 1
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this function started
            proc.wait()
        GROUPS.stop()
    controller, modules, main = GROUPS.at(time.time())
    return dict(
        rc=proc.returncode,
        wall=time.time() - started,
        started=started,
        controller_cpu=controller,
        module_cpu=modules,
        main_cpu=main,
        peak_rss_mb=peak_main / 1024,
        peak_pss_mb=peak_pss / 1024,
    )


def read_profile(work: Workdir, run: dict) -> dict:
    """Per task: hosts, wall (its start to the next task's), controller and module CPU; start-up; failures."""
    events = [json.loads(line) for line in work.profile.read_text().splitlines()]
    marks = [e for e in events if e["event"] in ("task", "end")]
    tasks = []
    for index, mark in enumerate(marks[:-1]):
        nxt = marks[index + 1]
        (c0, m0, p0), (c1, m1, p1) = GROUPS.at(mark["t"]), GROUPS.at(nxt["t"])
        results = [e for e in events if e["event"] == "result" and mark["t"] <= e["t"] < nxt["t"]]
        tasks.append(
            dict(
                name=mark["name"],
                hosts=len(results),
                failed=sum(1 for e in results if e["status"] in ("failed", "unreachable")),
                wall=nxt["t"] - mark["t"],
                controller_cpu=c1 - c0,
                module_cpu=m1 - m0,
                main_cpu=p1 - p0,
            )
        )
    first = marks[0]["t"] if marks else run["started"]
    return dict(
        tasks=tasks,
        failed=sum(task["failed"] for task in tasks),
        startup_wall=first - run["started"],
        startup_cpu=GROUPS.at(first)[0],
        finish_wall=run["started"] + run["wall"] - marks[-1]["t"] if marks else 0.0,
    )


def push_run(parent: Path, nodes: int, timeout: float) -> dict:
    work = Workdir(parent, f"push-{nodes}")
    work.seed_warm_image()
    argv = [
        str(BIN / "ansible-playbook"),
        str(PLAYBOOKS / "run_multi.yml"),
        "--check",
        "-f",
        str(nodes),
        "-e",
        json.dumps(
            {
                "ansible_connection": "local",
                "ansible_python_interpreter": str(work.interpreter),
                "image_cache_dir": str(work.path / "cache"),
                "postprocessing_fail_on_failure": False,
            }
        ),
    ]
    run = run_playbook(argv, work.env(nodes), timeout)
    run.update(read_profile(work, run), nodes=nodes, workdir=str(work.path))
    return run


def pull_node_run(parent: Path, nodes: int, rank: int, timeout: float) -> dict:
    """One node's part of a pull-mode run, as the pull step starts it (sbatch.pull_step_argv)."""
    from slurm_multi.submission.sbatch import PULL_NODE_VARS

    work = Workdir(parent, f"pull-{nodes}-r{rank}")
    work.seed_warm_image()
    node = nodelist(nodes)[1][rank]
    extra = {"ansible_python_interpreter": str(work.interpreter), "image_cache_dir": str(work.path / "cache")}
    if rank > 0:
        # Check mode neither writes rank 0's announcement nor reads it (image_announcement returns no image ID),
        # and the worker's load then refuses None as an ID: this extra var stands in for what it would have read.
        extra["announced_image"] = {"reference": work.image_name, "image_id": IMAGE_ID}
    argv = [
        str(BIN / "ansible-playbook"),
        str(PLAYBOOKS / "run_multi.yml"),
        "--check",
        "--limit",
        node,
        "-e",
        PULL_NODE_VARS,
        "-e",
        json.dumps(extra),
    ]
    env = work.env(
        nodes,
        {
            "SLURMD_NODENAME": node,
            "MAD_BARRIER_TOKEN": secrets.token_hex(24),
            "SLURM_MULTI_RUN_NONCE": secrets.token_hex(16),
        },
    )
    run = run_playbook(argv, env, timeout)
    run.update(read_profile(work, run), nodes=nodes, rank=rank, workdir=str(work.path))
    return run


def collect_run(parent: Path, nodes: int, timeout: float) -> dict:
    """The batch host's postprocessing after a pull-mode run: collect.yml over the N nodes (check mode)."""
    work = Workdir(parent, f"collect-{nodes}")
    work.seed_warm_image()
    argv = [
        str(BIN / "ansible-playbook"),
        str(PLAYBOOKS / "collect.yml"),
        "--check",
        "-e",
        json.dumps(
            {
                "ansible_python_interpreter": str(work.interpreter),
                "collect_job_id": JOB_ID,
                "collect_model": {"name": "dummy"},
                "postprocessing_fail_on_failure": False,
            }
        ),
    ]
    run = run_playbook(argv, work.env(nodes), timeout)
    run.update(read_profile(work, run), nodes=nodes, workdir=str(work.path))
    return run


def _median(runs: list, key) -> float:
    return statistics.median(key(run) for run in runs)


def print_push(results: dict) -> None:
    print("\nPush mode (run_multi.yml --check, -f N, local connection), medians over repeats:")
    print(
        f"{'N':>4} {'tasks':>5} {'failed':>6} {'wall/task':>9} {'ctl CPU/task':>12} {'per host':>9} {'main/task':>9} "
        f"{'startup':>7} {'total wall':>10} {'ctl CPU':>8} {'node CPU':>8} {'main RSS':>8} {'PSS peak':>8}"
    )
    for nodes, runs in sorted(results.items()):
        ok = [r for r in runs if "error" not in r]
        if not ok:
            print(f"{nodes:>4} {runs[0]['error']}")
            continue
        count = len(ok[0]["tasks"])
        wall_task = _median(ok, lambda r: sum(t["wall"] for t in r["tasks"]) / len(r["tasks"]))
        ctl_task = _median(ok, lambda r: sum(t["controller_cpu"] for t in r["tasks"]) / len(r["tasks"]))
        with_main = [r for r in ok if "main_cpu" in r] or [{"tasks": [{"main_cpu": float("nan")}]}]
        main_task = _median(with_main, lambda r: sum(t["main_cpu"] for t in r["tasks"]) / len(r["tasks"]))
        print(
            f"{nodes:>4} {count:>5} {max(r['failed'] for r in ok):>6} {wall_task:>8.2f}s {ctl_task:>11.3f}s "
            f"{1000 * ctl_task / nodes:>7.1f}ms {main_task:>8.3f}s {_median(ok, lambda r: r['startup_wall']):>6.1f}s "
            f"{_median(ok, lambda r: r['wall']):>9.1f}s {_median(ok, lambda r: r['controller_cpu']):>7.1f}s "
            f"{_median(ok, lambda r: r['module_cpu']):>7.1f}s {_median(ok, lambda r: r['peak_rss_mb']):>6.0f}MB "
            f"{_median(ok, lambda r: r['peak_pss_mb']):>6.0f}MB"
        )


def print_tasks(results: dict) -> None:
    """Per task and N (first repeat): wall, controller CPU, node (module) CPU."""
    sizes = sorted(n for n, runs in results.items() if runs and "error" not in runs[0])
    if not sizes:
        return
    print("\nPer task, first repeat: wall s / controller CPU s / node CPU s")
    names = [t["name"] for t in results[sizes[-1]][0]["tasks"]]
    print(f"{'task':<50}" + "".join(f"{'N=' + str(n):>20}" for n in sizes))
    for index, name in enumerate(names):
        cells = []
        for n in sizes:
            tasks = results[n][0]["tasks"]
            t = tasks[index] if index < len(tasks) and tasks[index]["name"] == name else None
            cells.append(f"{t['wall']:5.2f}/{t['controller_cpu']:5.2f}/{t['module_cpu']:5.1f}" if t else "-")
        print(f"{name[:49]:<50}" + "".join(f"{c:>20}" for c in cells))


def print_single(results: list, title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'N':>4} {'rank':>4} {'rc':>3} {'failed':>6} {'tasks':>5} {'wall':>6} {'startup':>7} {'ctl CPU':>8} "
        f"{'node CPU':>8} {'main RSS':>8}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['nodes']:>4} {r.get('rank', '-'):>4} {r['error']}")
            continue
        print(
            f"{r['nodes']:>4} {r.get('rank', '-'):>4} {r['rc']:>3} {r['failed']:>6} {len(r['tasks']):>5} "
            f"{r['wall']:>5.1f}s {r['startup_wall']:>6.1f}s {r['controller_cpu']:>7.2f}s {r['module_cpu']:>7.2f}s "
            f"{r['peak_rss_mb']:>6.0f}MB"
        )


INVENTORY_PROBE = """
import os, resource, sys, time
mode, nodes = sys.argv[1], [f"sim{i:04d}" for i in range(1, int(sys.argv[2]) + 1)]
from ansible import context
from ansible.module_utils.common.collections import ImmutableDict
context.CLIARGS = ImmutableDict({})
from ansible.plugins.loader import init_plugin_loader
init_plugin_loader()  # as the CLI does: ansible.cfg's collections_path holds the collection of module_utils
from ansible.parsing.dataloader import DataLoader
from ansible.inventory.manager import InventoryManager
started = time.perf_counter()
if mode == "plugin":  # the real slurm_allocation plugin, as ansible-playbook parses it
    InventoryManager(loader=DataLoader(), sources=["inventory/slurm.yml"])
else:  # the same variables through Ansible's inventory wrapper, allocation_nodes once on `all` (private API)
    from ansible._internal._datatag._tags import Origin
    from ansible.inventory.data import InventoryData
    from ansible.inventory.manager import _InventoryDataWrapper
    from ansible.plugins.inventory import BaseInventoryPlugin
    inventory = _InventoryDataWrapper(InventoryData(), BaseInventoryPlugin(), Origin(path="/probe"))
    for group in ("primary", "workers"):
        inventory.add_group(group)
    inventory.set_variable("all", "allocation_nodes", list(nodes))
    for rank, node in enumerate(nodes):
        inventory.add_host(node, group="primary" if rank == 0 else "workers")
        for key, value in dict(node_rank=rank, nnodes=len(nodes), master_addr="127.0.0.1", master_port=29500,
                               slurm_job_id="990001", ansible_connection="local").items():
            inventory.set_variable(node, key, value)
print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def inventory_probe(sizes: list) -> None:
    """Parse time and peak RSS of the allocation inventory: the plugin, and allocation_nodes once as a group var."""
    print("\nInventory of an N-node allocation: parse time, peak RSS of the parsing process")
    empty_site = Path(tempfile.mkdtemp(prefix="inventory-probe-")) / "site.yml"
    empty_site.touch()  # an empty site file: none of this machine's settings
    for nodes in sizes:
        for mode in ("plugin", "group-var"):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MAD_"))}
            expression, _ = nodelist(nodes)
            env.update(SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST=expression, SLURM_JOB_NUM_NODES=str(nodes))
            env.update(MASTER_ADDR="127.0.0.1", SLURM_MULTI_SITE_CONFIG=str(empty_site))
            out = subprocess.run(
                [sys.executable, "-c", INVENTORY_PROBE, mode, str(nodes)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            label = "slurm_allocation plugin" if mode == "plugin" else "allocation_nodes on `all`"
            print(f"  N={nodes:>5} {label:<26} {float(out[0]):7.2f} s {float(out[1]):6.0f} MB", flush=True)


def print_all(push: dict, pull: list, collect: list) -> None:
    print_push(push)
    print_tasks(push)
    print_single(pull, "Pull mode: one node's own ansible-playbook (run_multi.yml --check --limit <node>, mode=pull)")
    print_single(collect, "Pull mode: the batch host's collect.yml over N nodes (--check)")


def print_saved(paths: list) -> int:
    """The tables of one or more --json files (their push runs merged per N: the repeats of several runs)."""
    push, pull, collect = {}, [], []
    for path in paths:
        saved = json.loads(path.read_text())
        for nodes, runs in saved["push"].items():
            push.setdefault(int(nodes), []).extend(run for run in runs if "error" not in run)
        pull += saved["pull"]
        collect += saved["collect"]
    print_all({n: runs for n, runs in push.items() if runs}, pull, collect)
    return 0


def _guarded(function, *args) -> dict:
    try:
        return function(*args)
    except TimeoutError as exc:
        return {"error": str(exc), "nodes": args[1]}


def _counts(option: str) -> list[int]:
    """Host counts given as `1,8,32`; empty for none (`--pull-nodes ''` runs push mode alone)."""
    return [int(n) for n in option.split(",") if n.strip()]


def main() -> int:
    global GROUPS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,8,32,64,128,256", help="push-mode host counts (comma-separated)")
    parser.add_argument("--pull-nodes", default="1,64,256", help="allocation sizes for pull mode's one-node runs")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one ansible-playbook may take")
    parser.add_argument(
        "--stop-after", type=float, default=300, help="skip larger N once one push run took this many seconds"
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' temp dirs (their results and logs)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument("--print", nargs="+", type=Path, metavar="JSON", help="only print the tables of --json files")
    parser.add_argument("--inventory", metavar="N,N", help="only time the allocation inventory at these sizes")
    args = parser.parse_args()
    if args.print:
        return print_saved(args.print)
    if args.inventory:
        inventory_probe([int(n) for n in args.inventory.split(",")])
        return 0
    GROUPS = CpuGroups()
    parent = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    print(f"runs under {parent}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    push, pull, collect = {}, [], []
    try:
        too_slow = False
        for nodes in _counts(args.nodes):
            push[nodes] = []
            for _ in range(args.repeat):
                if too_slow:
                    push[nodes].append({"error": f"skipped: a smaller N took over {args.stop_after:.0f} s"})
                    break
                run = _guarded(push_run, parent, nodes, args.timeout)
                push[nodes].append(run)
                wall = run.get("wall", args.timeout)
                print(
                    f"  push N={nodes}: {wall:.1f}s rc={run.get('rc')} failed={run.get('failed')} "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                too_slow = wall > args.stop_after
        for nodes in _counts(args.pull_nodes):
            for rank in sorted({0, min(1, nodes - 1)}):
                for _ in range(args.repeat):
                    pull.append(_guarded(pull_node_run, parent, nodes, rank, args.timeout))
                    print(f"  pull N={nodes} rank {rank}: {pull[-1].get('wall', 0):.1f}s", flush=True)
            collect.append(_guarded(collect_run, parent, nodes, args.timeout))
        print_push(push)
        print_tasks(push)
        print_single(
            pull, "Pull mode: one node's own ansible-playbook (run_multi.yml --check --limit <node>, mode=pull)"
        )
        print_single(collect, "Pull mode: the batch host's collect.yml over N nodes (--check)")
        if args.json:
            args.json.write_text(json.dumps({"push": push, "pull": pull, "collect": collect}, indent=1))
    finally:
        GROUPS.remove()
        if args.keep:
            print(f"kept {parent}")
        else:
            shutil.rmtree(parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
