#!/usr/bin/env python3
"""Rank-0 barrier vs torch's TCPStore as a barrier, with 16, 256 and 1024 simulated workers on loopback.

Each round runs rank 0 (our RankBarrierServer, or a TCPStore master) in its own process and the workers as
threads spread over a few other processes; every worker thread waits at a common start gate, then:

    ours       connect, send READY, read WAIT (acknowledged), read GO (released)
    TCPStore   connect (client constructor), add("arrived", 1) (acknowledged by its reply);
               the worker whose add returns N sets "go"; every worker wait(["go"]) (released)

Figures (from CLOCK_MONOTONIC, shared by the processes):

    joined       start gate -> the last worker's announcement acknowledged by rank 0
    release      the last READY / add sent -> each worker released (median and max over workers)
    total        start gate -> the last worker released

A round with --idle N first opens N connections to our rank 0 that never send anything (they stay open past
the release), to show they do not delay it. torch is optional: without it, our barrier runs alone.

    .venv/bin/python benchmarks/barrier_bench.py                       # 16, 256, 1024 workers, 3 repeats
    .venv/bin/python benchmarks/barrier_bench.py --sizes 64 --repeat 1 --no-torch
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_multi.paths import use_project_module_utils  # noqa: E402

use_project_module_utils()

from ansible.module_utils.rank_barrier import (  # noqa: E402
    RankBarrierServer,
    format_ready_line,
    raise_open_files_limit,
)

# torch's C++ warnings (one per client socket) would bury the table.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

ADDRESS = "127.0.0.1"
NETNS_MARK = "BARRIER_BENCH_IN_NETNS"
TOKEN = "bench-token-0123456789abcdef"
IMAGE = "sha256:" + "e" * 64
ROUND_TIMEOUT = 120.0
# Rank 0 shares this machine's few CPUs with a thousand simulated workers; on a cluster it has a node to itself.
RANK0_NICE = -10
# The workers' threads block in recv; a small stack keeps a thousand of them cheap.
THREAD_STACK_BYTES = 256 * 1024

# fork, not spawn: rounds start in milliseconds. The parent never imports torch, so no torch threads are forked.
CONTEXT = multiprocessing.get_context("fork")


# ------------------------------------------------------------------------------------------------ rank 0 processes


def stand_alone_priority() -> None:
    """Give rank 0 the CPU before the simulated workers, as if it had its own node (both barriers alike)."""
    try:
        os.nice(RANK0_NICE)
    except OSError:
        pass  # not root: the figures then include more CPU contention with the workers


def serve_ours(nworkers: int, idle_timeout: float, listening, done) -> None:
    """Rank 0: our barrier for `nworkers` workers; reports its port, then how it ended."""
    stand_alone_priority()
    with socket.socket() as probe:
        probe.bind((ADDRESS, 0))
        port = probe.getsockname()[1]
    with RankBarrierServer(ADDRESS, [port], nworkers + 1, IMAGE, TOKEN, idle_timeout=idle_timeout) as server:
        server.listen()
        listening.put(port)
        result = server.serve(timeout=ROUND_TIMEOUT)
        done.put(("released", len(result.workers), len(result.rejections)))


def serve_tcpstore(listening, stop) -> None:
    """Rank 0: a TCPStore master, until told to stop."""
    from torch.distributed import TCPStore

    stand_alone_priority()  # before the store starts its server thread, which inherits it
    store = TCPStore(ADDRESS, 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=ROUND_TIMEOUT))
    listening.put(store.port)
    stop.wait(ROUND_TIMEOUT)


# -------------------------------------------------------------------------------------------------------- workers


def worker_ours(port: int, rank: int, nworkers: int, keep: list):
    """One worker on our protocol: (ready_sent, acknowledged, released) times."""
    line = format_ready_line(TOKEN, rank, f"sim{rank:05d}", IMAGE)
    sock = socket.create_connection((ADDRESS, port), timeout=ROUND_TIMEOUT)
    keep.append(sock)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    replies = sock.makefile("rb")
    ready_sent = time.monotonic()
    sock.sendall(line)
    if replies.readline() != b"WAIT\n":
        raise RuntimeError("rank 0 did not acknowledge READY")
    acknowledged = time.monotonic()
    if replies.readline() != b"GO\n":
        raise RuntimeError("rank 0 did not send GO")
    return ready_sent, acknowledged, time.monotonic()


def worker_tcpstore(port: int, rank: int, nworkers: int, keep: list):
    """One worker on a TCPStore used as a barrier: (ready_sent, acknowledged, released) times."""
    from torch.distributed import TCPStore

    store = TCPStore(ADDRESS, port, is_master=False, timeout=datetime.timedelta(seconds=ROUND_TIMEOUT))
    keep.append(store)
    ready_sent = time.monotonic()
    arrived = store.add("arrived", 1)
    acknowledged = time.monotonic()
    if arrived == nworkers:
        store.set("go", "1")
    store.wait(["go"])
    return ready_sent, acknowledged, time.monotonic()


WORKERS = {"ours": worker_ours, "tcpstore": worker_tcpstore}


def worker_process(kind: str, port: int, ranks, nworkers: int, armed, gate, results) -> None:
    """Run the given ranks as threads that all wait at `gate`; send back each one's times (or its error)."""
    raise_open_files_limit(2 * len(ranks) + 256)
    threading.stack_size(THREAD_STACK_BYTES)
    if kind == "tcpstore":
        import torch.distributed  # noqa: F401 - imported before the gate, not inside the timed part
    run_worker = WORKERS[kind]
    times = {}
    # Connections are closed and threads end only once every worker was released: that work would otherwise
    # compete with the workers still waking up, and be measured as release latency.
    connections = []
    everyone_released = threading.Barrier(len(ranks))

    def run(rank):
        gate.wait()
        try:
            times[rank] = run_worker(port, rank, nworkers, connections)
        except Exception as error:  # noqa: BLE001 - reported by the parent as a failed round
            times[rank] = f"{type(error).__name__}: {error}"
        everyone_released.wait()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    armed.put(os.getpid())
    for thread in threads:
        thread.join()
    for connection in connections:
        if isinstance(connection, socket.socket):
            connection.close()
    results.put(times)


# ---------------------------------------------------------------------------------------------------------- rounds


def run_round(kind: str, nworkers: int, processes: int, idle: int) -> dict:
    """One barrier with `nworkers` workers; its figures in milliseconds."""
    listening, done, armed, results = (CONTEXT.Queue() for _ in range(4))
    gate, stop = CONTEXT.Event(), CONTEXT.Event()
    if kind == "ours":
        rank0 = CONTEXT.Process(target=serve_ours, args=(nworkers, ROUND_TIMEOUT, listening, done))
    else:
        rank0 = CONTEXT.Process(target=serve_tcpstore, args=(listening, stop))
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
                args=(kind, port, ranks[index::processes], nworkers, armed, gate, results),
            )
            child.start()
            children.append(child)
        for _ in range(processes):
            armed.get(timeout=60)
        time.sleep(0.2)  # let every thread reach the gate
        started = time.monotonic()
        gate.set()
        times = {}
        for _ in range(processes):
            times.update(results.get(timeout=ROUND_TIMEOUT))
        if kind == "ours":
            outcome = done.get(timeout=10)
            if outcome[1] != nworkers:
                raise RuntimeError(f"rank 0 released {outcome[1]} workers, expected {nworkers}")
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
    last_ready = max(ready for ready, _, _ in times.values())
    if os.environ.get("BENCH_DEBUG"): print(f"clients: first ready {min(r for r,_,_ in times.values()):.4f} last ready {last_ready:.4f} first go {min(g for _,_,g in times.values()):.4f} last go {max(g for _,_,g in times.values()):.4f}", file=sys.stderr)
    release = sorted(released - last_ready for _, _, released in times.values())
    return {
        "joined": 1000 * (max(ack for _, ack, _ in times.values()) - started),
        "release_p50": 1000 * statistics.median(release),
        "release_max": 1000 * release[-1],
        "total": 1000 * (max(released for _, _, released in times.values()) - started),
    }


def summarize(rounds) -> dict:
    """Repeats of one configuration -> medians, and the worst release of any repeat."""
    summary = {key: statistics.median(r[key] for r in rounds) for key in ("joined", "release_p50", "total")}
    summary["release_max"] = max(r["release_max"] for r in rounds)
    return summary


NAMES = {"ours": "rank_barrier", "tcpstore": "TCPStore"}


def print_table(rows) -> None:
    header = f"{'barrier':<13} {'workers':>7} {'idle':>5} {'joined ms':>10} {'release p50 ms':>15} " \
             f"{'release max ms':>15} {'total ms':>9}"
    print(header)
    print("-" * len(header))
    for (kind, nworkers, idle), s in rows.items():
        print(f"{NAMES[kind]:<13} {nworkers:>7} {idle:>5} {s['joined']:>10.1f} {s['release_p50']:>15.1f} "
              f"{s['release_max']:>15.1f} {s['total']:>9.1f}")


def print_targets(rows, sizes, idle: int) -> None:
    print("\nTargets (issue 5):")
    for nworkers in sizes:
        ours, theirs = rows.get(("ours", nworkers, 0)), rows.get(("tcpstore", nworkers, 0))
        if ours and theirs:
            beaten = [key for key in ("joined", "release_p50", "release_max", "total") if ours[key] < theirs[key]]
            print(f"  {nworkers:>5} workers: faster than TCPStore on {len(beaten)}/4 figures ({', '.join(beaten)})")
    if ("ours", 1024, 0) in rows:
        worst = rows[("ours", 1024, 0)]["release_max"]
        print(f"  1024 workers: max release {worst:.1f} ms (target <= 100 ms): {'met' if worst <= 100 else 'MISSED'}")
    if ("ours", 256, 0) in rows:
        joined = rows[("ours", 256, 0)]["joined"]
        print(f"  256 workers: all joined in {joined:.1f} ms (target <= 1000 ms): {'met' if joined <= 1000 else 'MISSED'}")
    for nworkers in sizes:
        quiet, loaded = rows.get(("ours", nworkers, 0)), rows.get(("ours", nworkers, idle))
        if idle and quiet and loaded:
            print(f"  {nworkers:>5} workers + {idle} idle connections: release max {loaded['release_max']:.1f} ms "
                  f"vs {quiet['release_max']:.1f} ms without (rank 0 rejected none of them before GO)")


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
    os.execvp("unshare", ["unshare", "--net", "--", "sh", "-c", script, sys.executable, __file__, *argv])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024], help="simulated worker counts")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per configuration (medians are reported)")
    parser.add_argument("--processes", type=int, default=2, help="processes the worker threads are spread over")
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
    rows = {}
    for kind, nworkers, idle in configurations:
        rounds = [run_round(kind, nworkers, args.processes, idle) for _ in range(args.repeat)]
        rows[(kind, nworkers, idle)] = summarize(rounds)
    print_table(rows)
    print_targets(rows, args.sizes, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
