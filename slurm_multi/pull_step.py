"""Pull mode's step, as the batch host runs it: srun, ended when a node of the run is lost.

    python -m slurm_multi.pull_step VARS_FILE -- srun ...    # sbatch.pull_step_argv

A node that dies never reports its task's end, and srun would wait for it until the time limit. So srun runs under
this process, which gives the step a fresh run nonce, finds the attempt dir the nodes claim with it, and kills srun
once every node has written its status.json or is lost (no status, its playbook heartbeat stood still for
`heartbeat_stale` seconds) and one at least is lost; the job script then collects at once. Signals reach srun
directly: this process only outlives them, to give srun's exit code.
"""

import argparse
import contextlib
import glob
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import (
    HEARTBEAT_STALE_SECONDS,
    PLAYBOOK_HEARTBEAT_FILE,
    Heartbeat,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.run_claim import RUN_CLAIM_FILE
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight import (
    result_path as preflight_result_path,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import expand_nodelist
from slurm_multi.submission.job_vars import read_job_vars

POLL_SECONDS = 2


def claimed_attempt_dir(results_dir: str, attempt: int, nonce: str) -> str | None:
    """The attempt dir a run with `nonce` claimed in `results_dir` (any job ID: a sweep's model, a second run's
    `.run2`, an explicit one), or None before its first node claimed it."""
    pattern = os.path.join(glob.escape(results_dir), "*", f"attempt-{attempt}", RUN_CLAIM_FILE)
    for claim in glob.glob(pattern):
        try:
            if safe_files.read_json_file(claim).get("nonce") == nonce:
                return os.path.dirname(claim)
        except (OSError, ValueError, AttributeError):
            continue  # being written, or not a run's claim: never ours
    return None


class LostNodes:
    """Which nodes of a run are lost, read from its attempt dir (see the module docstring)."""

    def __init__(self, results_dir: str, attempt: int, nonce: str, nodes: Sequence[str], stale_after: float):
        self._find = lambda: claimed_attempt_dir(results_dir, attempt, nonce)
        self._nodes = list(nodes)
        self._stale_after = stale_after
        self._attempt_dir: str | None = None
        self._beats: dict[str, Heartbeat] = {}
        self._preflights: dict[str, Heartbeat] = {}

    def check(self) -> list[tuple[str, str]]:
        """(node, why) of every lost node once each node is done or lost; [] while a node still may finish."""
        if self._attempt_dir is None:
            self._attempt_dir = self._find()
            if self._attempt_dir is None:
                return []
            self._beats = {
                node: Heartbeat(os.path.join(job_layout.nodes_dir(self._attempt_dir), node, PLAYBOOK_HEARTBEAT_FILE),
                                self._stale_after)
                for node in self._nodes
            }  # fmt: skip
            # Before its first beat, a node's playbook last showed life by its preflight result: a loaded machine
            # may take longer than the stale time from the run's claim to the first beat (the preparation stage's).
            self._preflights = {
                node: Heartbeat(preflight_result_path(self._attempt_dir, node), self._stale_after)
                for node in self._nodes
            }
        lost, running = [], False
        for node in self._nodes:
            if os.path.exists(os.path.join(job_layout.nodes_dir(self._attempt_dir), node, job_layout.STATUS_FILE)):
                continue
            # Both every time: a beat's clock runs from when it was last seen.
            stopped = self._beats[node].stopped()
            if self._preflights[node].stopped() is None:
                stopped = None
            if stopped:
                lost.append((node, stopped))
            else:
                running = True
        return [] if running else lost


def exit_code(returncode: int) -> int:
    """subprocess's return code as a shell gives it: 128 + the signal that killed the process."""
    return 128 - returncode if returncode < 0 else returncode


def run(vars_file: str, command: Sequence[str]) -> int:
    """Run the pull step's `command` (srun ...) to its end, or until a node is lost; its exit code."""
    job_vars = read_job_vars(vars_file)
    nonce = secrets.token_hex(16)  # new for each pull step, the same on all its nodes
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    watch = LostNodes(
        str(job_vars.get("results_dir") or ""),
        job_layout.attempt_from_env(os.environ),
        nonce,
        expand_nodelist(nodelist) if nodelist else [],
        float(job_vars.get("heartbeat_stale") or HEARTBEAT_STALE_SECONDS),
    )
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, lambda *_: None)  # srun got it too, and stops its step
    srun = subprocess.Popen(list(command), env=dict(os.environ, SLURM_MULTI_RUN_NONCE=nonce))
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return exit_code(srun.wait(timeout=POLL_SECONDS))
        lost = watch.check() if job_vars.get("results_dir") else []
        if lost:
            names = "; ".join(f"{node} {why}" for node, why in lost)
            print(
                f"slurm-multi: lost {names}, and wrote no status.json while every other node finished: ending the "
                "pull step, whose srun would wait for the lost node until the time limit",
                flush=True,
            )
            srun.kill()
            return exit_code(srun.wait())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_multi.pull_step", description=__doc__.splitlines()[0])
    parser.add_argument("vars_file", help="the job's vars file (results_dir, heartbeat_stale)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the pull step's srun command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no srun command after --")
    return run(args.vars_file, command)


if __name__ == "__main__":
    sys.exit(main())
