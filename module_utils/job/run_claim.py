"""Which run an attempt dir belongs to: every run claims its own before it writes anything there.

Engineers iterate inside one allocation, so ``ansible-playbook playbooks/run_multi.yml`` may run twice under one
SLURM job ID and attempt (``SLURM_RESTART_COUNT``). Each run carries a nonce, fresh for each playbook run (pull
mode: for each pull step, one for all its nodes), and the first thing it does is to claim
``<results_dir>/<job_id>/attempt-<N>/run.json``, created with O_EXCL, holding that nonce and the run's origin (the
cluster, the job ID and when SLURM started the job). Then:

* the dir is free: the run takes it;
* it holds this run's nonce: another node of the same run claimed it first (pull mode), the run takes it;
* it holds another run of the same allocation: this run is a new one, ``<job_id>.run2`` (then ``.run3``, ...), with
  its own dirs, record and perf row - never another run's verdict;
* it holds a run from elsewhere (another cluster sharing the results dir, or SLURM's job IDs started again): the
  run stops before any build, naming the dir.

A job ID given explicitly (a sweep's model, ``slurm-multi run --job-id``) gets no number: it is that run or none.
Node side and controller side alike: standard library only, Python 3.8+.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from typing import Mapping, Optional

from ansible.module_utils import safe_files
from ansible.module_utils.job import layout as job_layout
from ansible.module_utils.job.layout import JobLayoutError
from ansible.module_utils.results import dir_trust as results_dir_trust

RUN_CLAIM_FILE = "run.json"
# The second run of an allocation is <job_id>.run2: a suffix no SLURM job ID and no sweep model (<job_id>.<k>) has.
RUN_NUMBER_SEPARATOR = ".run"


def run_origin(cluster: Optional[str], slurm_job_id: Optional[str], job_start: Optional[str], host: str) -> str:
    """What tells this allocation from any other that had the same job ID: SLURM's cluster, the job ID and the
    job's start time; outside SLURM, the host (a local run's ID is new every time)."""
    if not slurm_job_id:
        return f"local run on {host}"
    return f"cluster {cluster or '?'}, job {slurm_job_id} started {job_start or '?'}"


def claim_run(results_dir: str, job_id: str, attempt: int, nonce: str, origin: str, numbered: bool = True) -> str:
    """The job ID this run writes under, its attempt dir claimed for it (see the module docstring)."""
    job_id = job_layout.validate_job_id(job_id)
    if not nonce or not str(nonce).strip():
        raise JobLayoutError(
            "the run has no nonce: run it through run_multi.yml, which gives it one (a pull-mode node takes its "
            "step's SLURM_MULTI_RUN_NONCE, which slurm_multi/pull_step.py sets)"
        )
    for number in itertools.count(1):
        run_id = job_id if number == 1 else f"{job_id}{RUN_NUMBER_SEPARATOR}{number}"
        attempt_path = job_layout.attempt_dir(results_dir, run_id, attempt)
        results_dir_trust.make_job_dirs(attempt_path, results_dir)
        claim = _claim(os.path.join(attempt_path, RUN_CLAIM_FILE), {"nonce": nonce, "origin": origin})
        if claim.get("nonce") == nonce:
            return run_id
        if claim.get("origin") != origin:
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
