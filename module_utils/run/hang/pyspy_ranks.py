"""Inside a model's container: ``py-spy record`` of every rank, one flame graph per rank (the pyspy_record tool), run
as ``python3 -c <this source> <the model's command...>``. Python 3.6 syntax, standard library only."""

import collections
import os
import shlex
import signal
import subprocess
import sys
import time

# Where the tool mounts the node's own py-spy binary, read-only (nothing is installed into the image).
PYSPY = "/slurm-multi/bin/py-spy"
POLL_SECONDS = 0.5
# After the model's command ended: how long the recorders get to write their graphs before they are interrupted
# (py-spy writes its graph on SIGINT too), and then before they are killed.
FINISH_SECONDS = 30.0
INTERRUPTED_SECONDS = 10.0
LAUNCHER_SCRIPTS = ("torchrun", "deepspeed", "accelerate")
LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
    "accelerate.commands.launch",
)
# Python's options that take a value in the next argument.
_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")


# One process of the container as /proc shows it; rank: its RANK, else NODE_RANK, else None.
Process = collections.namedtuple("Process", "pid ppid exe argv rank")


def is_python(process):
    """A Python interpreter (python, python3, python3.11...), whatever script it runs."""
    return os.path.basename(process.exe).startswith("python")


def is_launcher(argv):
    """Whether a Python command line runs a launcher (torchrun, ``-m torch.distributed.run``...), not a rank."""
    arguments = iter(argv[1:])
    for argument in arguments:
        if argument in _VALUE_OPTIONS:
            next(arguments, None)
        elif argument == "-m" or (argument.startswith("-m") and not argument.startswith("--")):
            module = argument[2:] or next(arguments, "")
            return module in LAUNCHER_MODULES
        elif argument == "-c" or argument == "-":
            return False
        elif not argument.startswith("-"):
            return os.path.basename(argument) in LAUNCHER_SCRIPTS
    return False


def rank_processes(processes, watcher_pid):
    """{pid: rank} of the rank processes that descend from ``watcher_pid`` among ``processes`` ({pid: Process})."""
    candidates = {
        pid
        for pid, process in processes.items()
        if process.rank is not None and is_python(process) and not is_launcher(process.argv)
    }
    ranks = {}
    for pid in candidates:
        ancestor, walked = processes[pid].ppid, set()
        # Up to the nearest candidate or the watcher; a snapshot taken while processes come and go may hold a loop.
        while ancestor in processes and ancestor not in candidates | {watcher_pid} | walked:
            walked.add(ancestor)
            ancestor = processes[ancestor].ppid
        if ancestor == watcher_pid:
            ranks[pid] = processes[pid].rank
    return ranks


def _read(path):
    with open(path, "rb") as handle:
        return handle.read()


def read_process(pid, proc="/proc"):
    """The process ``pid`` from /proc, or None where it is gone or unreadable (a kernel thread, a race)."""
    where = os.path.join(proc, str(pid))
    try:
        stat = _read(os.path.join(where, "stat")).decode("utf-8", "replace")
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        exe = os.readlink(os.path.join(where, "exe"))
        argv = [part.decode("utf-8", "replace") for part in _read(os.path.join(where, "cmdline")).split(b"\0")[:-1]]
        environ = dict(
            entry.decode("utf-8", "replace").partition("=")[::2]
            for entry in _read(os.path.join(where, "environ")).split(b"\0")
            if entry
        )
    except (OSError, ValueError, IndexError):
        return None
    return Process(pid, ppid, exe, argv, environ.get("RANK") or environ.get("NODE_RANK"))


def process_table(proc="/proc"):
    """{pid: Process} of every process in sight (the container's, in its own PID namespace)."""
    table = {}
    for name in os.listdir(proc):
        if name.isdigit():
            process = read_process(int(name), proc)
            if process is not None:
                table[process.pid] = process
    return table


def graph_path(tools_dir, rank, pid, taken):
    """``pyspy-rank<rank>.svg``; a second process of the same rank (which should not be) gets its pid added."""
    name = f"pyspy-rank{rank}.svg"
    if name in taken:
        name = f"pyspy-rank{rank}-pid{pid}.svg"
    taken.add(name)
    return os.path.join(tools_dir, name)


def _finish(recorders):
    """Let the recorders write their graphs (their ranks are gone), interrupting, then killing, the slow ones."""
    for timeout, stop in ((FINISH_SECONDS, signal.SIGINT), (INTERRUPTED_SECONDS, signal.SIGKILL)):
        deadline = time.monotonic() + timeout
        for recorder in recorders:
            try:
                recorder.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                recorder.send_signal(stop)
    for recorder in recorders:
        recorder.wait()


def main(command, pyspy=PYSPY):
    """Run ``command`` with every rank recorded; the command's exit code (128 + N when signal N ended it)."""
    tools_dir = os.environ.get("SLURM_MULTI_TOOLS_DIR", ".")
    options = shlex.split(os.environ.get("PYSPY_RECORD_OPTIONS", ""))
    model = subprocess.Popen(command)
    recorders, recorded, taken = [], set(), set()
    while model.poll() is None:
        for pid, rank in sorted(rank_processes(process_table(), os.getpid()).items()):
            if pid not in recorded:
                recorded.add(pid)
                output = graph_path(tools_dir, rank, pid, taken)
                try:
                    recorders.append(
                        subprocess.Popen([pyspy, "record", "--pid", str(pid), "--output", output] + options)
                    )
                except OSError as err:  # the model runs on unrecorded: the tool must not end it
                    print(f"pyspy_record: cannot record rank {rank} (pid {pid}): {err}", file=sys.stderr)
        time.sleep(POLL_SECONDS)
    _finish(recorders)
    return model.returncode if model.returncode >= 0 else 128 - model.returncode


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("pyspy_record: no command to run (the tool's cmd goes in front of the model's command)")
    sys.exit(main(sys.argv[1:]))
