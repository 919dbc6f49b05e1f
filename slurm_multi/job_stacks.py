"""`slurm-multi stacks JOB`: every rank's Python stacks of a running job, taken on its nodes, the job going on.

One ``srun --overlap`` step in the job's allocation, one task per node, runs module_utils/run/hang/stacks.py on each
(py-spy from the host, writing ``stacks-<UTC time>.txt`` beside the node's log); this side prints each node's file,
in the job's node order.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang import stacks
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import project_root
from slurm_multi.reports.job_view import job_nodelist
from slurm_multi.submission import sbatch
from slurm_multi.submission.secrets import without_secrets

# The step starts in the job's allocation at once (--overlap); the dumps take a fraction of a second per process.
STEP_TIMEOUT = 120


def stacks_srun_argv(job_id: str, nodes: list[str], attempt_dir: str, python: str, stamp: str) -> list[str]:
    """The one step that takes the stacks on every node of the job: one task each, beside the running step; each
    writes ``stacks-<stamp>.txt``."""
    return [
        "srun", "--jobid", job_id, "--overlap", "--nodes", str(len(nodes)), "--ntasks-per-node", "1",
        "--nodelist", ",".join(nodes), "--quiet",
        python, "-m", stacks.__name__, "--job", job_id, "--attempt-dir", attempt_dir, "--stamp", stamp,
    ]  # fmt: skip


def _running_job(job_id: str) -> tuple[dict, list[str]]:
    info = sbatch.job_info(job_id)
    if info is None:
        raise SlurmMultiError(f"SLURM knows no job {job_id}: check the ID (squeue --me lists your jobs)")
    state = info.get("JobState", "")
    if state != "RUNNING":
        raise SlurmMultiError(
            f"job {job_id} is {state or 'in no known state'}, not running: a running job's stacks are taken live; "
            "a run the hang watchdog ended left its ranks' stacks in nodes/<node>/stacks.txt of its attempt"
        )
    return info, job_nodelist(info)


def node_reports(output: str) -> dict[str, dict]:
    """Each node's JSON line of the step's output, by node; lines that are not one (srun's own) are skipped."""
    reports = {}
    for line in output.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and "node" in report:
            reports[str(report["node"])] = report
    return reports


def job_stacks(job_id: str, results_dir: str | Path, say=lambda message: None) -> tuple[list[str], list[str]]:
    """(each node's stacks text, in the job's node order; what went wrong on a node). Raises SlurmMultiError when
    the job is not running or its results dir is not found."""
    job_id = job_layout.validate_job_id(job_id)  # before it reaches scontrol's argv: `-x` is no job
    info, nodes = _running_job(job_id)
    restarts = info.get("Restarts", "0")
    attempt = int(restarts) if restarts.isdigit() else job_layout.latest_attempt(str(results_dir), job_id)
    attempt_dir = job_layout.attempt_dir(str(results_dir), job_id, attempt)
    if not os.path.isdir(attempt_dir):
        raise SlurmMultiError(
            f"job {job_id} has no attempt dir {attempt_dir}: give the results dir it writes to (--results-dir), or "
            "wait until its pipeline has prepared its nodes"
        )
    say(f"job {job_id}: taking the stacks on {', '.join(nodes)} (one srun task each, beside the running step)")
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    argv = stacks_srun_argv(job_id, nodes, attempt_dir, sys.executable, stamp)
    env = dict(without_secrets(os.environ), PYTHONPATH=str(project_root() / "collections"))
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    except FileNotFoundError:
        raise SlurmMultiError("`srun` is not on PATH: run this on a SLURM login node") from None
    except subprocess.TimeoutExpired:
        raise SlurmMultiError(f"the stacks step in job {job_id} took more than {STEP_TIMEOUT} s") from None
    reports = node_reports(done.stdout)
    texts, problems = [], []
    for node in nodes:
        report = reports.get(node)
        if report is None:
            problems.append(f"{node}: no answer from its task: {(done.stderr.strip() or 'srun said nothing')[-500:]}")
        elif report.get("error"):
            problems.append(f"{node}: {report['error']}")
        else:
            texts += [Path(path).read_text(encoding="utf-8", errors="replace") for path in report.get("files", [])]
    return texts, problems
