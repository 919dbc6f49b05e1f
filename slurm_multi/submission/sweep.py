"""A sweep's runs in its one allocation: one pipeline run per image, in order, then the sweep's record.

Model k runs as job ``<job_id>.<k>`` (module_utils/results/model_sweep.py): the first run's rank 0 builds every image
of the sweep into the sweep's manifest, each later run takes its image from it without building, and every run
writes its own record. A model that fails does not stop the others unless ``stop_on_failure``; the sweep's record
(job ``<job_id>``) covers them all. The job script starts `main` in place of the pipeline; `slurm-multi run` calls
`run_sweep` with its own way of running one model.
"""

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    load_manifest,
    read_build_failures,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import SKIPPED, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import (
    cards_of_manifest,
    new_sweep_plan,
    plan_after_build,
    record_sweep,
    write_sweep_plan,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import load_record
from slurm_multi.submission.job_vars import read_job_vars, write_job_vars
from slurm_multi.submission.sbatch import allocation_nodes

MANIFEST_FILE = "build_manifest.json"


def sweep_manifest_path(results_dir: str, job_id: str, attempt: int) -> str:
    """Where the first model's run builds every image of the sweep: the sweep's own attempt dir."""
    return os.path.join(job_layout.attempt_dir(results_dir, job_id, attempt), MANIFEST_FILE)


def model_run_vars(model: Mapping[str, Any], manifest: str, nodes: Sequence[str], attempt: int) -> dict[str, Any]:
    """The vars one model's run adds to the job's: its job ID, its image in the sweep's manifest, its card for
    collect. The first run builds (no manifest_path); the later ones run from the manifest it wrote."""
    run_vars: dict[str, Any] = {
        "job_id": model["job_id"],
        "sweep_manifest": manifest,
        "sweep_index": model.get("manifest_index", model["index"] - 1),
        "collect_job_id": model["job_id"],
        "collect_attempt": attempt,
        "collect_model": dict(model.get("card") or {"name": model["model"]}),
    }
    if nodes:
        run_vars["collect_nodes"] = list(nodes)
    if model["index"] > 1:
        run_vars["manifest_path"] = manifest
    return run_vars


def run_sweep(
    results_dir: str,
    job_id: str,
    attempt: int,
    cards: Sequence[Mapping[str, Any]],
    run_model: Callable[[Mapping[str, Any], dict[str, Any]], int],
    *,
    stop_on_failure: bool = False,
    nodes: Sequence[str] = (),
    on_progress: Callable[[str], None] = print,
    stopped: Callable[[], str | None] = lambda: None,
    manifest: str | None = None,
) -> dict[str, Any]:
    """Run each model of the sweep (``run_model(model, run_vars)``), then write and return the sweep's record.

    ``cards`` are the planned images' cards (`JobSpec.sweep`); once the first run has built, the sweep's manifest
    says what runs (the nodes may have narrowed the Dockerfile variants). ``stopped`` returns why the sweep must
    not start another model (SIGTERM, the time limit), or None. ``manifest``: a sweep of a given manifest's
    images (MAD's build_manifest.json, the job's ``manifest_path``), which builds nothing.
    """
    plan = new_sweep_plan(job_id, attempt, cards, stop_on_failure)
    write_sweep_plan(results_dir, plan)
    manifest = manifest or sweep_manifest_path(results_dir, job_id, attempt)
    stop_reason = None
    index = 0
    while index < len(plan["models"]):
        model = plan["models"][index]
        total = len(plan["models"])
        on_progress(f"slurm-multi: model {model['index']} of {total}: {model['model']} (job {model['job_id']})")
        if not model.get("not_run"):
            run_model(model, model_run_vars(model, manifest, nodes, attempt))
        if index == 0:
            plan, stop_reason = _plan_after_build(plan, manifest, on_progress)
            write_sweep_plan(results_dir, plan)
        record = load_record(results_dir, model["job_id"], attempt)
        status = record.get("status") if record else model.get("not_run") or "FAILURE (no record)"
        on_progress(f"slurm-multi: model {model['index']} of {len(plan['models'])}: {model['model']} {status}")
        stop_reason = stop_reason or stopped()
        if stop_reason is None and stop_on_failure and status not in (SUCCESS, SKIPPED):
            stop_reason = f"not run: model {model['index']} ({model['model']}) failed and the sweep stops on failure"
        if stop_reason:
            break
        index += 1
    return record_sweep(results_dir, job_id, attempt, nodes=nodes, not_run_reason=stop_reason)


def _plan_after_build(plan: dict, manifest: str, on_progress: Callable[[str], None]) -> tuple[dict, str | None]:
    """The plan for the models after the first, from what its build made: (plan, why the sweep stops or None)."""
    try:
        failures = read_build_failures(manifest)
        built = cards_of_manifest(load_manifest(manifest)) if os.path.exists(manifest) or not failures else []
    except (ManifestError, OSError, ValueError):
        # The build failed as a whole (a card or the daemon): the first model's record says why.
        return plan, "not run: the sweep's build failed (see the first model's record)"
    new_plan = plan_after_build(plan, built, failures)
    if [(m["model"], m.get("not_run")) for m in new_plan["models"]] != [(m["model"], None) for m in plan["models"]]:
        on_progress(
            f"slurm-multi: the build made {len(built)} of the sweep's images"
            + "".join(f"; {failure['model']}: failed to build" for failure in failures)
        )
    stop = None
    if failures and plan["stop_on_failure"]:
        stop = f"not run: the build of {failures[0]['model']} failed and the sweep stops on failure"
    return new_plan, stop


def main(argv: Sequence[str] | None = None) -> int:
    """The job script's sweep: each model's run is the pipeline argv given after ``--`` with the model's vars
    (a 0600 vars file beside the job's, so its values stay data), then collect.yml when it left no record."""
    parser = argparse.ArgumentParser(prog="python -m slurm_multi.submission.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--vars-file", required=True, type=Path, help="the job's vars file")
    parser.add_argument("--ansible-playbook", required=True, help="ansible-playbook, for collect.yml")
    parser.add_argument("--playbooks", required=True, type=Path, help="the playbooks dir")
    parser.add_argument("pipeline", nargs=argparse.REMAINDER, help="-- the pipeline's argv")
    args = parser.parse_args(argv)
    pipeline = [word for word in args.pipeline if word != "--"] if args.pipeline[:1] == ["--"] else args.pipeline
    job_vars = read_job_vars(args.vars_file)
    results_dir = str(job_vars["results_dir"])
    job_id = job_layout.job_id_for_run(os.environ.get("SLURM_JOB_ID"))
    attempt = job_layout.attempt_from_env(os.environ)
    nodes = allocation_nodes(os.environ)
    why_stopped: list[str] = []

    def on_signal(signum, _frame):
        # The job script signals this process group: the running model's pipeline stops itself gently (it got the
        # same signal); no further model starts.
        why_stopped.append(f"not run: the sweep was stopped ({signal.Signals(signum).name})")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGUSR1, on_signal)

    def run_model(model: Mapping[str, Any], run_vars: dict[str, Any]) -> int:
        model_vars = args.vars_file.parent / f"sweep-{attempt}-{model['index']}.json"
        write_job_vars(model_vars, run_vars)
        rc = _call(pipeline + ["-e", f"@{model_vars}"])
        if load_record(results_dir, model["job_id"], attempt) is None:
            _call(
                [args.ansible_playbook, str(args.playbooks / "collect.yml"), "-e", f"@{args.vars_file}", "-e",
                 f"@{model_vars}", "-e", '{"postprocessing_fail_on_failure": false}']
            )  # fmt: skip
        return rc

    record = run_sweep(
        results_dir,
        job_id,
        attempt,
        job_vars.get("sweep_models") or [],
        run_model,
        stop_on_failure=bool(job_vars.get("stop_on_failure")),
        nodes=nodes,
        on_progress=lambda line: print(line, flush=True),
        stopped=lambda: why_stopped[0] if why_stopped else None,
        manifest=job_vars.get("manifest_path") or None,
    )
    print(f"slurm-multi: sweep {job_id}: {record.get('status')} {record.get('reason') or ''}".rstrip(), flush=True)
    return 0 if record.get("status") in (SUCCESS, SKIPPED) else 1


def _call(argv: Sequence[str]) -> int:
    """Run a child to its end, even when a signal interrupts the wait (it got the signal too and stops gently)."""
    child = subprocess.Popen(list(argv))
    while True:
        try:
            return child.wait()
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
