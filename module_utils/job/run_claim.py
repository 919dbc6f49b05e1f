"""Which run an attempt dir belongs to: every run claims its own ``run.json`` before it writes anything there
(docs/contracts.md); a transient SLURM error must never decide who owns a run dir. Standard library only."""

from __future__ import annotations

import itertools
import json
import os
import re
import uuid
from typing import List, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    slurm_job_id_from_env,
    squeue_job_field,
)

RUN_CLAIM_FILE = "run.json"
# The second run of an allocation is <job_id>.run2: a suffix no SLURM job ID and no sweep model (<job_id>.<k>) has.
RUN_NUMBER_SEPARATOR = ".run"
# The job's start as squeue prints it, set by a pull-mode job script (or `slurm-multi run`) once for every node.
JOB_START_ENV = "SLURM_MULTI_JOB_START"
UNKNOWN = "?"
_SLURM_ORIGIN = re.compile(r"cluster (?P<cluster>.+), job (?P<job>\S+) started (?P<start>.+)\Z")


def run_origin(cluster: Optional[str], slurm_job_id: Optional[str], job_start: Optional[str], host: str) -> str:
    """What tells this allocation from any other that had the same job ID: SLURM's cluster, the job ID and the
    job's start time; outside SLURM, the host (a local run's ID is new every time)."""
    if not slurm_job_id:
        return f"local run on {host}"
    return f"cluster {cluster or UNKNOWN}, job {slurm_job_id} started {job_start or UNKNOWN}"


def allocation_origin(environ: Mapping[str, str], host: str, warnings: List[str]) -> str:
    """This run's origin (`run_origin`) from its environment, the job's start from JOB_START_ENV or else squeue;
    a start squeue would not tell appends a warning saying so and why."""
    slurm_job_id = slurm_job_id_from_env(environ)
    start = (environ.get(JOB_START_ENV) or "").strip()
    if slurm_job_id and not start:
        start, problem = squeue_job_field(slurm_job_id, "%S")
        if problem:
            warnings.append(
                f"SLURM did not say when job {slurm_job_id} started ({problem}): a run dir of this job already "
                "in the results dir is told from another allocation's by the cluster and the job ID alone"
            )
    return run_origin(environ.get("SLURM_CLUSTER_NAME"), slurm_job_id, start, host)


def _same_allocation(theirs: str, ours: str) -> tuple:
    """(whether a claim's origin is this run's allocation, judged by what both sides know; whether that took the
    claim's unknown start time on trust). An unknown field (``?``) is no evidence either way."""
    found, this = _SLURM_ORIGIN.match(theirs), _SLURM_ORIGIN.match(ours)
    if not found or not this:
        return theirs == ours, False
    if found["job"] != this["job"]:
        return False, False
    for name in ("cluster", "start"):
        if UNKNOWN not in (found[name], this[name]) and found[name] != this[name]:
            return False, False
    return True, found["start"] == UNKNOWN and this["start"] != UNKNOWN


def claim_run(
    results_dir: str,
    job_id: str,
    attempt: int,
    nonce: str,
    origin: str,
    numbered: bool = True,
    warnings: Optional[List[str]] = None,
) -> str:
    """The job ID this run writes under, its attempt dir claimed for it (see the module docstring). A dir judged
    this allocation's only because its claim's start time is unknown appends a warning to `warnings`."""
    job_id = job_layout.validate_job_id(job_id)
    if not nonce or not str(nonce).strip():
        raise JobLayoutError(
            "the run has no nonce: run it through run_multi.yml, which gives it one (a pull-mode node takes its "
            "step's SLURM_MULTI_RUN_NONCE, which slurm_multi/pull_step.py sets)"
        )
    trusted = []  # attempt dirs taken as this allocation's though their claim's start is unknown
    for number in itertools.count(1):
        run_id = job_id if number == 1 else f"{job_id}{RUN_NUMBER_SEPARATOR}{number}"
        attempt_path = job_layout.attempt_dir(results_dir, run_id, attempt)
        results_dir_trust.make_job_dirs(attempt_path, results_dir)
        claim = _claim(os.path.join(attempt_path, RUN_CLAIM_FILE), {"nonce": nonce, "origin": origin})
        if claim.get("nonce") == nonce:
            if trusted and warnings is not None:
                warnings.append(
                    f"{', '.join(trusted)} {'holds a run' if len(trusted) == 1 else 'hold runs'} of job {job_id} "
                    "whose start SLURM did not say when claimed: taken as this allocation's (the cluster and the "
                    f"job ID match this run's), so this run is {run_id}"
                )
            return run_id
        same, on_trust = _same_allocation(str(claim.get("origin") or ""), origin)
        if on_trust:
            trusted.append(attempt_path)
        if not same:
            raise JobLayoutError(
                f"{attempt_path} holds a run from elsewhere ({claim.get('origin') or 'no origin recorded'}; this "
                f"run is {origin}): another cluster shares this results dir, or SLURM's job IDs started again. "
                f"Give this job its own results_dir, or move {job_layout.job_dir(results_dir, run_id)} aside"
            )
        if not numbered:
            raise JobLayoutError(
                f"{attempt_path} holds another run of job {run_id} attempt {attempt} (this allocation's): give this "
                "run a job ID of its own"
            )
    raise AssertionError("unreachable")


def _claim(path: str, claim: Mapping[str, str]) -> dict:
    """The claim in ``path``: ours when we made it, else the one there. Written to a temp file and linked into place
    (link(2) never replaces a name), so another node of the run never reads it half-written."""
    temp_path = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    with open(temp_path, "x", encoding="utf-8") as handle:
        json.dump(dict(claim), handle)
    try:
        os.link(temp_path, path)
        return dict(claim)
    except FileExistsError:
        try:
            found = safe_files.read_json_file(path)
        except (OSError, ValueError) as exc:
            raise JobLayoutError(f"{path} cannot be read ({exc}): move its job dir aside") from None
        return found if isinstance(found, dict) else {}
    finally:
        os.unlink(temp_path)
