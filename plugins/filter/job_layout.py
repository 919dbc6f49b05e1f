"""Filters: what tasks need of a job's layout (its ID, its paths, a node's status.json); the logic is
module_utils/job/layout.py's, so the roles and the Python side cannot disagree."""

import os
import socket

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import defaults, run_claim
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import merge_steps


def attempt_results_dir(results_dir, job_id, attempt):
    """``<results_dir>/<job_id>/attempt-<attempt>``: one attempt's dir (its ABORT marker, manifest, nodes)."""
    try:
        return job_layout.attempt_dir(str(results_dir), str(job_id), attempt)
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def node_results_dir(results_dir, job_id, attempt, node):
    """``<results_dir>/<job_id>/attempt-<attempt>/nodes/<node>``: a node's results for one attempt of the job."""
    try:
        return job_layout.node_dir(str(results_dir), str(job_id), attempt, str(node))
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def node_workspace(node_dir, job_id, attempt, node, run_context=None):
    """A node's copy of the model's scripts (module_utils/job/layout.py): in its ``node_dir``, or under the run
    context's ``slurm.shared_workspace`` (madengine's key)."""
    slurm = (run_context or {}).get("slurm") or {}
    shared = slurm.get("shared_workspace") if isinstance(slurm, dict) else None
    try:
        return job_layout.node_workspace(str(node_dir), str(job_id), attempt, str(node), shared and str(shared))
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def node_status_path(results_dir, job_id, attempt, node):
    """``<node_results_dir>/status.json``: the node's status for one attempt of the job."""
    try:
        return job_layout.status_path(str(results_dir), str(job_id), attempt, str(node))
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def job_id_for_run(slurm_job_id):
    """The run's job ID: the allocation's SLURM job ID, else a new local run ID (``local-<time>-<hex>``)."""
    try:
        return job_layout.job_id_for_run(None if slurm_job_id is None else str(slurm_job_id))
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def claim_run_id(job_id, results_dir, attempt, nonce, numbered=True):
    """The job ID this run writes under, its attempt dir claimed for it (module_utils/job/run_claim.py): ``job_id``
    itself, or, when another run of this allocation holds that dir and ``numbered``, ``<job_id>.run2`` and on.
    ``job_id`` none or empty: the allocation's (SLURM_JOB_ID), else a new local run ID."""
    warnings = []
    try:
        origin = run_claim.allocation_origin(os.environ, socket.gethostname(), warnings)
        base = job_layout.job_id_for_run(None if job_id in (None, "") else str(job_id))
        claimed = run_claim.claim_run(
            str(results_dir), base, int(attempt), str(nonce), origin, bool(numbered), warnings=warnings
        )
        if claimed != base:
            warnings.append(
                f"Another run of this allocation already holds job {base} attempt {attempt}: this run is job "
                f"{claimed}, with its own results dir, record and perf row."
            )
        return claimed
    except (OSError, job_layout.JobLayoutError) as exc:
        raise AnsibleFilterError(str(exc)) from None
    finally:
        for warning in warnings:
            Display().warning(warning)


def node_steps(results):
    """The step times a node's registered module results carry, ``{step: {start, end}}``
    (module_utils/results/timeline.merge_steps): what the run module and a failed stage's rescue write into
    status.json."""
    return merge_steps(results if isinstance(results, (list, tuple)) else [results])


def stage_failure_status(
    node, rank, nnodes, job_id, model="", stage="preparation", failed_result=None, failed_task=None, steps=None
):
    """The status.json a failed stage's rescue writes for ``node`` (job_layout.stage_failure_status): the error is
    ``failed_result``'s ``msg`` (None when another node's failure stopped this one), else the failed task's name."""
    failed_result = _failed_item(failed_result, str(node))
    failed = failed_result if isinstance(failed_result, dict) else {}
    error = None if failed_result is None else failed.get("msg") or f"task {failed_task or '?'} failed"
    try:
        return job_layout.stage_failure_status(
            str(node),
            rank,
            nnodes,
            job_id,
            str(model or ""),
            str(stage),
            error=error,
            aborted_by_rank=failed.get("aborted_by_rank"),
            steps=dict(steps or {}, **merge_steps([failed_result])),
            # The preflight stage's problems on this node (node_preflight's result).
            preflight=failed.get("problems"),
        )
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def _failed_item(failed_result, node):
    """The result whose error is ``node``'s: a run-once loop that sets each node's (item's) facts fails as one task
    whose msg ("One or more items failed") names nothing, so its failed item for this node, else its first failed
    item, carries the error."""
    items = failed_result.get("results") if isinstance(failed_result, dict) else None
    if not isinstance(items, list):
        return failed_result
    failed = [item for item in items if isinstance(item, dict) and item.get("failed")]
    return next((item for item in failed if item.get("item") == node), failed[0] if failed else failed_result)


def pipeline_default(name):
    """The default of setting ``name`` from its one home (module_utils/job/defaults.py): group_vars/all.yml reads
    every default through this filter, so the playbooks, the modules and the CLI default alike."""
    try:
        return defaults.pipeline_default(str(name))
    except KeyError as exc:
        raise AnsibleFilterError(exc.args[0]) from None


def setting_problems(host_vars):
    """What the settings table refuses among the settings of ``host_vars`` (a host's variables), one sentence each:
    the job checks with `slurm-multi submit`'s own check (module_utils/job/defaults.py)."""
    values = {name: host_vars[name] for name in defaults.SETTINGS if name in host_vars}
    return defaults.setting_problems(values)


class FilterModule:
    def filters(self):
        return {
            "setting_problems": setting_problems,
            "attempt_results_dir": attempt_results_dir,
            "node_results_dir": node_results_dir,
            "node_status_path": node_status_path,
            "node_workspace": node_workspace,
            "job_id_for_run": job_id_for_run,
            "claim_run_id": claim_run_id,
            "stage_failure_status": stage_failure_status,
            "node_steps": node_steps,
            "pipeline_default": pipeline_default,
        }
