"""Pull mode's task on each node: run_multi.yml against this node, outlived until the run module it started is done
when SLURM stops the job.

    python pull_node.py ANSIBLE_PLAYBOOK ARGS...    # the pull step's command (sbatch.pull_step_argv)

When SLURM stops the job, ansible-playbook dies at once while the run module it started still stops the container
and writes the node's status; but once a step's task has exited, SLURM kills what is left of the step. So the task
is this process: a child subreaper that starts ansible-playbook and, after a stop signal, waits for every descendant
(SLURM's SIGKILL, KillWait after its TERM, still bounds the wait). Standard library only: it runs on every node.
"""

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux 3.4 and newer); False where the kernel cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal that killed the process."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def run(argv: list) -> int:
    """Run argv (ansible-playbook and its arguments) with SLURM_MULTI_PLAYBOOK_PID set to its own pid (rank 0's
    heartbeat beats while that process lives); its exit code, once every descendant is done after a stop signal."""
    stopped = []

    def stop(signum, _frame):
        stopped.append(signum)
        if playbook:
            with contextlib.suppress(ProcessLookupError):
                os.kill(playbook, signum)  # where SLURM signals only the task, the playbook still hears it

    playbook = 0
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    become_subreaper()
    playbook = os.fork()
    if playbook == 0:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        os.environ["SLURM_MULTI_PLAYBOOK_PID"] = str(os.getpid())
        try:
            os.execvp(argv[0], argv)
        except OSError as error:
            print(f"pull_node.py: cannot run {argv[0]}: {error.strerror or error}", file=sys.stderr)
        os._exit(127)
    _, status = os.waitpid(playbook, 0)
    if stopped:
        # The run module and what it started, orphaned by the playbook's death and adopted here.
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
    return exit_code(status)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: pull_node.py ANSIBLE_PLAYBOOK ARGS...")
    sys.exit(run(sys.argv[1:] + ["--limit", os.environ.get("SLURMD_NODENAME", "")]))
