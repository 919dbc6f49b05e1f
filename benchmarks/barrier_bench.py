#!/usr/bin/env python3
"""Rank-0 barrier vs torch's TCPStore as a barrier, with 16, 256 and 1024 simulated workers on loopback.

Each round runs rank 0 (our RankBarrierServer, or a TCPStore master) in a fresh process and the workers as
threads spread over a few other processes. Every worker thread connects at a first gate (ours: a TCP
connection, JOIN, and rank 0's HELLO checked against the token; TCPStore: its client constructor, which also
validates the connection with a round trip), then, once every worker is connected and rank 0 had time to accept
them all, announces itself at a second gate:

    ours       send READY with its MAC (joined when rank 0 has checked and accepted it), read GO and check its
               MAC (released)
    TCPStore   add("arrived", 1) (joined when its reply arrives); the worker whose add returns N sets "go";
               every worker wait(["go"]) (released)

Both rank 0s keep their connections open until the round ends: TCPStore's master closes nothing by itself,
and ours leaves the closing to its close(), after the release.

Two gates, because rank 0 of this sandbox accepts a burst of connections late (see benchmarks/README.md):
connecting inside the announcement window would charge that to whichever barrier connects last.

Figures (from CLOCK_MONOTONIC, shared by the processes):

    connect      first gate -> the last worker connected
    joined       second gate -> the last announcement registered (ours: accepted by rank 0, from its own
                 report; TCPStore: its reply back at the worker, one loopback hop later)
    released     how many workers were released, the smallest count of any repeat (a round where one was not
                 is an error, not a figure)
    release      the last READY / add sent -> each worker released (median and max over workers)
    total        second gate -> the last worker released
    rank 0 CPU   CPU time rank 0's process spent on the round (all its threads): the server's own cost,
                 free of the simulated workers' scheduling

A round with --idle N first opens N connections to our rank 0 that never send anything (they stay open past
the release), to show they do not delay it. torch is optional: without it, our barrier runs alone.

    .venv/bin/python -m benchmarks.barrier_bench                       # 16, 256, 1024 workers, 3 repeats
    .venv/bin/python -m benchmarks.barrier_bench --repeat 5 --processes 4
    .venv/bin/python -m benchmarks.barrier_bench --sizes 64 --repeat 1 --no-torch
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import threading
import time

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import ReadyMessage
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.server import RankBarrierServer
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    Session,
    message_mac,
    new_nonce,
    raise_open_files_limit,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.worker import WorkerConnection

# torch's C++ warnings (one per client socket) would bury the table.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

ADDRESS = "127.0.0.1"
NETNS_MARK = "BARRIER_BENCH_IN_NETNS"
TOKEN = "bench-token-0123456789abcdef"
JOB = "bench-job"
IMAGE = "sha256:" + "e" * 64
ROUND_TIMEOUT = 120.0
# Rank 0 shares this machine's few CPUs with a thousand simulated workers; on a cluster it has a node to itself.
RANK0_NICE = -10
# The workers' threads block in recv; a small stack keeps a thousand of them cheap.
THREAD_STACK_BYTES = 256 * 1024

# Workers: fork, so that a round starts in milliseconds (the parent never imports torch: no torch threads are
# forked). Rank 0: a fresh interpreter, as the Ansible module is; a forked one would pay copy-on-write page
# faults on the parent's objects inside the timed window.
CONTEXT = multiprocessing.get_context("fork")
RANK0_CONTEXT = multiprocessing.get_context("spawn")


# ------------------------------------------------------------------------------------------------ rank 0 processes


def stand_alone_priority() -> None:
    """Give rank 0 the CPU before the simulated workers, as if it had its own node (both barriers alike)."""
    try:
        os.nice(RANK0_NICE)
    except OSError:
        pass  # not root: the figures then include more CPU contention with the workers


def serve_ours(nworkers: int, idle_timeout: float, listening, stop, done) -> None:
    """Rank 0: our barrier for `nworkers` workers, open until told to stop; reports its port, then how many it
    released, its CPU time and when the last READY was accepted."""
    stand_alone_priority()
    with socket.socket() as probe:
        probe.bind((ADDRESS, 0))
        port = probe.getsockname()[1]
    with RankBarrierServer(
        ADDRESS, [port], nworkers + 1, IMAGE, TOKEN, idle_timeout=idle_timeout, job_id=JOB
    ) as server:
        server.listen()
        listening.put(port)
        cpu_before = time.process_time()
        serving_since = time.monotonic()
        result = server.serve(timeout=ROUND_TIMEOUT)
        last_arrival = serving_since + max(worker["arrived_seconds"] for worker in result.workers)
        done.put((len(result.workers), time.process_time() - cpu_before, last_arrival))
        stop.wait(ROUND_TIMEOUT)


def serve_tcpstore(listening, stop, done) -> None:
    """Rank 0: a TCPStore master, until told to stop; then reports its CPU time."""
    from torch.distributed import TCPStore

    stand_alone_priority()  # before the store starts its server thread, which inherits it
    store = TCPStore(
        ADDRESS, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=ROUND_TIMEOUT)
    )
    cpu_before = time.process_time()
    listening.put(store.port)
    stop.wait(ROUND_TIMEOUT)
    done.put((None, time.process_time() - cpu_before, None))


# -------------------------------------------------------------------------------------------------------- workers


def connect_ours(port: int, rank: int):
    """A worker's connection to our rank 0, greeted: the real worker's code (WorkerConnection), which also makes
    its READY line and the GO line it expects right after the greeting."""
    deadline = time.monotonic() + ROUND_TIMEOUT
    message = ReadyMessage(rank, f"sim{rank:05d}", IMAGE)
    return WorkerConnection.open(ADDRESS, port, deadline, TOKEN, JOB, message, ROUND_TIMEOUT, ROUND_TIMEOUT)


def announce_ours(connection, rank: int, nworkers: int):
    """One worker at our barrier: (ready_sent, joined, released) times; joined comes from rank 0's report."""
    ready_sent = time.monotonic()
    connection.announce(ready_sent + ROUND_TIMEOUT)
    return ready_sent, None, time.monotonic()


def connect_tcpstore(port: int, rank: int):
    """A worker's TCPStore client (its constructor connects and validates the connection)."""
    from torch.distributed import TCPStore

    return TCPStore(ADDRESS, port, is_master=False, timeout=datetime.timedelta(seconds=ROUND_TIMEOUT))


def announce_tcpstore(store, rank: int, nworkers: int):
    """One worker at a TCPStore used as a barrier: (ready_sent, joined, released) times."""
    ready_sent = time.monotonic()
    arrived = store.add("arrived", 1)
    acknowledged = time.monotonic()
    if arrived == nworkers:
        store.set("go", "1")
    store.wait(["go"])
    return ready_sent, acknowledged, time.monotonic()


WORKERS = {"ours": (connect_ours, announce_ours), "tcpstore": (connect_tcpstore, announce_tcpstore)}


def worker_process(kind: str, port: int, ranks, nworkers: int, gates, progress, results) -> None:
    """Run the given ranks as threads: connect at the first gate, announce at the second; send back their times.

    Each rank's entry is (connected, ready_sent, joined, released), or the error it met.
    """
    raise_open_files_limit(2 * len(ranks) + 256)
    threading.stack_size(THREAD_STACK_BYTES)
    # First-use costs (imports, the resolver's set-up) are paid before the gates, not inside the timed part.
    if kind == "tcpstore":
        import torch.distributed  # noqa: F401
    socket.getaddrinfo(ADDRESS, port, type=socket.SOCK_STREAM)
    message_mac(TOKEN, "READY", Session(JOB, 1, "warm-up", new_nonce(), new_nonce()), IMAGE)
    connect, announce = WORKERS[kind]
    connect_gate, barrier_gate = gates
    times = {}
    # Connections are closed and threads end only once every worker was released: that work would otherwise
    # compete with the workers still waking up, and be measured as release latency.
    handles = {}
    all_connected = threading.Barrier(len(ranks) + 1)
    everyone_released = threading.Barrier(len(ranks))

    def run(rank):
        try:
            connect_gate.wait()
            handles[rank] = connect(port, rank)
            connected_at = time.monotonic()
        except Exception as error:  # noqa: BLE001 - reported by the parent as a failed round
            times[rank] = f"connect: {type(error).__name__}: {error}"
        all_connected.wait()
        barrier_gate.wait()
        if rank in handles:
            try:
                times[rank] = (connected_at,) + announce(handles[rank], rank, nworkers)
            except Exception as error:  # noqa: BLE001
                times[rank] = f"{type(error).__name__}: {error}"
        everyone_released.wait()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    progress.put("armed")
    all_connected.wait()
    progress.put("connected")
    for thread in threads:
        thread.join()
    for handle in handles.values():
        if isinstance(handle, WorkerConnection):
            handle.close()
    results.put(times)


# ---------------------------------------------------------------------------------------------------------- rounds


def run_round(kind: str, nworkers: int, processes: int, idle: int) -> dict:
    """One barrier with `nworkers` workers; its figures in milliseconds."""
    listening, done, stop = RANK0_CONTEXT.Queue(), RANK0_CONTEXT.Queue(), RANK0_CONTEXT.Event()
    progress, results = CONTEXT.Queue(), CONTEXT.Queue()
    connect_gate, barrier_gate = CONTEXT.Event(), CONTEXT.Event()
    if kind == "ours":
        rank0 = RANK0_CONTEXT.Process(target=serve_ours, args=(nworkers, ROUND_TIMEOUT, listening, stop, done))
    else:
        rank0 = RANK0_CONTEXT.Process(target=serve_tcpstore, args=(listening, stop, done))
    rank0.start()
    children = [rank0]
    idle_connections = []
    try:
        port = listening.get(timeout=60)
        idle_connections = [socket.create_connection((ADDRESS, port), timeout=10) for _ in range(idle)]
        ranks = list(range(1, nworkers + 1))
        for index in range(processes):
            child = CONTEXT.Process(
                target=worker_process,
                args=(kind, port, ranks[index::processes], nworkers, (connect_gate, barrier_gate), progress, results),
            )
            child.start()
            children.append(child)
        wait_for(progress, "armed", processes)
        time.sleep(0.2)  # let every thread reach the gate
        connecting = time.monotonic()
        connect_gate.set()
        wait_for(progress, "connected", processes)
        time.sleep(0.2)  # let rank 0 accept every connection
        started = time.monotonic()
        barrier_gate.set()
        times = {}
        for _ in range(processes):
            times.update(results.get(timeout=ROUND_TIMEOUT))
        stop.set()
        released_by_rank0, rank0_cpu, last_arrival = done.get(timeout=30)
        if released_by_rank0 not in (None, nworkers):
            raise RuntimeError(f"rank 0 released {released_by_rank0} workers, expected {nworkers}")
    finally:
        stop.set()
        for connection in idle_connections:
            connection.close()
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
                child.join()
    failures = [f"rank {rank}: {value}" for rank, value in times.items() if isinstance(value, str)]
    if failures or len(times) != nworkers:
        raise RuntimeError(f"{kind} round with {nworkers} workers failed: {failures[:3]}")
    connected, ready, joined, released = zip(*times.values(), strict=True)
    release = sorted(moment - max(ready) for moment in released)
    return {
        "released": len(released),
        "connect": 1000 * (max(connected) - connecting),
        "joined": 1000 * ((last_arrival or max(joined)) - started),
        "release_p50": 1000 * statistics.median(release),
        "release_max": 1000 * release[-1],
        "total": 1000 * (max(released) - started),
        "rank0_cpu": 1000 * rank0_cpu,
    }


def wait_for(progress, step: str, processes: int) -> None:
    """Block until every worker process reported `step`."""
    for _ in range(processes):
        reported = progress.get(timeout=120)
        if reported != step:
            raise RuntimeError(f"a worker process reported {reported!r} while waiting for {step!r}")


def summarize(rounds) -> dict:
    """Repeats of one configuration -> the median of each figure, and the worst release of any repeat."""
    summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    summary["released"] = min(r["released"] for r in rounds)
    summary["release_worst"] = max(r["release_max"] for r in rounds)
    return summary


NAMES = {"ours": "rank_barrier", "tcpstore": "TCPStore"}


COLUMNS = (  # (figure, heading, decimals)
    ("released", "released", 0),
    ("connect", "connect ms", 1),
    ("joined", "joined ms", 1),
    ("release_p50", "release p50 ms", 1),
    ("release_max", "release max ms", 1),
    ("release_worst", "worst max ms", 1),
    ("total", "total ms", 1),
    ("rank0_cpu", "rank 0 CPU ms", 1),
)


def print_table(rows) -> None:
    """One line per configuration, figures in milliseconds."""
    header = f"{'barrier':<13} {'workers':>7} {'idle':>5} " + " ".join(f"{heading:>14}" for _, heading, _ in COLUMNS)
    print(header)
    print("-" * len(header))
    for (kind, nworkers, idle), summary in rows.items():
        figures = " ".join(f"{summary[key]:>14.{decimals}f}" for key, _, decimals in COLUMNS)
        print(f"{NAMES[kind]:<13} {nworkers:>7} {idle:>5} {figures}")


def print_targets(rows, sizes, idle: int) -> None:
    print("\nTargets (issues 5 and 14):")
    for nworkers in sizes:
        ours, theirs = rows.get(("ours", nworkers, 0)), rows.get(("tcpstore", nworkers, 0))
        if ours and theirs:
            figures = [key for key, _, _ in COLUMNS if key != "released"]
            beaten = [key for key in figures if ours[key] < theirs[key]]
            print(
                f"  {nworkers:>5} workers: below TCPStore on {len(beaten)}/{len(figures)} figures "
                f"({', '.join(beaten) or 'none'})"
            )
    if ("ours", 1024, 0) in rows:
        worst = rows[("ours", 1024, 0)]["release_worst"]
        verdict = "met" if worst <= 100 else "MISSED"
        print(f"  1024 workers: max release {worst:.1f} ms in the worst repeat (target <= 100 ms): {verdict}")
    if ("ours", 256, 0) in rows:
        joined = rows[("ours", 256, 0)]["joined"]
        verdict = "met" if joined <= 1000 else "MISSED"
        print(f"  256 workers: all joined in {joined:.1f} ms (target <= 1000 ms): {verdict}")
    for nworkers in sizes:
        quiet, loaded = rows.get(("ours", nworkers, 0)), rows.get(("ours", nworkers, idle))
        if idle and quiet and loaded:
            print(
                f"  {nworkers:>5} workers + {idle} idle connections: release max {loaded['release_max']:.1f} ms "
                f"vs {quiet['release_max']:.1f} ms without, median of repeats (they stay connected past the "
                "release)"
            )


def reexec_in_private_network_namespace(argv) -> None:
    """Re-run this script in a network namespace of its own with only loopback up (root, `unshare`, `ip`).

    TCPStore reverse-resolves every client's address; glibc sends the IPv4-mapped 127.0.0.1 to DNS, which
    on a host with an unreachable resolver costs 5 s per client and sends queries off the machine. In a
    namespace with no route out the lookup fails at once, as it answers at once on a cluster with working
    DNS, and no other job's loopback ports can interfere with the figures.
    """
    if os.environ.get(NETNS_MARK) or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return
    os.environ[NETNS_MARK] = "1"
    script = 'ip link set lo up && exec "$0" "$@"'
    os.execvp(
        "unshare",
        ["unshare", "--net", "--", "sh", "-c", script, sys.executable, "-m", "benchmarks.barrier_bench", *argv],
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024], help="simulated worker counts")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per configuration (medians are reported)")
    parser.add_argument("--processes", type=int, default=4, help="processes the worker threads are spread over")
    parser.add_argument("--idle", type=int, default=100, help="idle connections in the extra rounds (0: none)")
    parser.add_argument("--no-torch", action="store_true", help="run our barrier alone")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    args = parser.parse_args(argv)
    if not args.no_netns:
        reexec_in_private_network_namespace(argv)

    raise_open_files_limit(4 * max(args.sizes) + args.idle + 256)
    kinds = ["ours"]
    if args.no_torch:
        print("TCPStore: skipped (--no-torch)")
    elif importlib.util.find_spec("torch") is None:
        print("TCPStore: torch is not importable (pip install torch==2.13.0 to compare); running ours alone")
    else:
        kinds.append("tcpstore")
    where = "a private network namespace" if os.environ.get(NETNS_MARK) else "the host's network namespace"
    print(f"{os.cpu_count()} CPUs, {args.processes} worker processes, {args.repeat} repeats, in {where}\n")

    configurations = [(kind, n, 0) for n in args.sizes for kind in kinds]
    if args.idle:
        configurations += [("ours", n, args.idle) for n in args.sizes]
    for kind in kinds:
        run_round(kind, min(args.sizes), args.processes, 0)  # warm-up, not reported: first-use costs
    # Repeats interleave the configurations, so that the machine's load drifts over all of them alike.
    rounds = {configuration: [] for configuration in configurations}
    for repeat in range(args.repeat):
        print(f"repeat {repeat + 1}/{args.repeat}", file=sys.stderr, flush=True)
        for kind, nworkers, idle in configurations:
            rounds[(kind, nworkers, idle)].append(run_round(kind, nworkers, args.processes, idle))
    rows = {configuration: summarize(figures) for configuration, figures in rounds.items()}
    print_table(rows)
    print_targets(rows, args.sizes, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
