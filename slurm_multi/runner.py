"""Running the pipeline here through ansible-runner: in this allocation (`run`), or its postprocessing (`collect`).

ansible-runner works in a fresh 0700 private data dir, removed after the run (its artifacts hold a copy of the
environment). Everything the pipeline reads goes to Ansible as unsafe extra vars (`job_vars`). ``MAD_SECRETS_*``
never reach Ansible's environment or variables: they go to a 0600 file whose path alone (``secrets_file``) the
pipeline gets.
"""

import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from secrets import token_hex
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import PULL
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SecretsError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import load_record, record_path
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    squeue_job_end,
    squeue_job_start,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import default_results_dir, new_private_dir
from slurm_multi.pipeline_stop import stop_pipeline
from slurm_multi.run_result import RunResult, job_result
from slurm_multi.spec import JobSpec, content_root
from slurm_multi.submission.credentials import write_credentials_copy
from slurm_multi.submission.job_vars import write_job_vars
from slurm_multi.submission.sbatch import allocation_nodes, find_ansible_playbook, pull_step_argv
from slurm_multi.submission.secrets import user_secrets, without_secrets, write_secrets_file
from slurm_multi.submission.sweep import run_sweep


def _ansible_env(root: Path) -> dict[str, str]:
    # This interpreter's scripts first: ansible-playbook of the same environment as the package.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {
        "ANSIBLE_CONFIG": str(root / "ansible.cfg"),
        # ansible-runner puts its own callback dir in ANSIBLE_CALLBACK_PLUGINS, which hides ansible.cfg's: ours go
        # first (the speed-up layer's, docs/speedup.md, enabled in ansible.cfg).
        "ANSIBLE_CALLBACK_PLUGINS": str(root / "plugins" / "callback"),
        "PATH": path,
        "ANSIBLE_FORCE_COLOR": "0",
    }


def run_playbook(
    playbook: str,
    job_vars: Mapping[str, Any],
    *,
    forks: int | None = None,
    on_event: Callable[[dict], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    root: Path | None = None,
    quiet: bool = True,
) -> int:
    """Run ``playbooks/<playbook>`` with ``job_vars`` as unsafe extra vars; return ansible-playbook's exit code.

    ``on_event`` receives each ansible-runner event; ``cancel`` is polled and stops the run when it returns True.
    """
    from ansible_runner import Runner, RunnerConfig

    root = content_root(root)
    private_data_dir = Path(tempfile.mkdtemp(prefix="slurm-multi-runner-"))
    try:
        (private_data_dir / "env").mkdir(mode=0o700)
        write_job_vars(private_data_dir / "env" / "extravars", job_vars)
        config = RunnerConfig(
            private_data_dir=str(private_data_dir),
            playbook=str(root / "playbooks" / playbook),
            project_dir=str(root),
            forks=forks,
            envvars=_ansible_env(root),
            quiet=quiet,
        )
        config.prepare()
        # The pipeline's ansible-playbook (slurm-multi-playbook), in place of the one ansible-runner names; its
        # `binary` option would run it in raw mode, without the playbook on the command line.
        if config.command[0] == "ansible-playbook":
            config.command[0] = str(find_ansible_playbook())
        config.env = without_secrets(config.env)

        def handle_event(event: dict) -> bool:
            if on_event is not None:
                on_event(event)
            return False  # nothing to keep: the private data dir goes when the run ends

        stopping: list[threading.Thread] = []

        def stop_gently() -> bool:
            # ansible-runner's own cancel SIGKILLs ansible-playbook's process group, which leaves the model
            # containers running: stop it as the job script does (slurm_multi/pipeline_stop.py), beside the
            # runner's event loop, which goes on reading the playbook's events meanwhile.
            if cancel is not None and not stopping and cancel():
                playbook = _playbook_of(private_data_dir)
                if playbook is not None:
                    stopping.append(
                        threading.Thread(target=stop_pipeline, args=(playbook, os.environ.get("SLURM_JOB_ID")))
                    )
                    stopping[0].start()
            return False

        runner = Runner(config=config, event_handler=handle_event, cancel_callback=stop_gently)
        runner.run()
        for stop in stopping:
            stop.join()  # this node's run module may still be writing its status.json
        return runner.rc if runner.rc is not None else 2
    finally:
        shutil.rmtree(private_data_dir, ignore_errors=True)


def _playbook_of(private_data_dir: Path) -> int | None:
    """The process group of the ansible-playbook that ansible-runner started for this run, or None once it ended.

    It is the child of this process whose command line names the run's own private data dir; any other child
    (the caller's own subprocesses) is left alone.
    """
    own_group = os.getpgrp()
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                group = os.getpgid(int(pid))
            except (OSError, ProcessLookupError):
                continue
            if str(private_data_dir) in cmdline and group != own_group:
                return group
    return None


def _run_pull_step(
    job_vars: Mapping[str, Any],
    nodes: list[str],
    private_dir: Path,
    root: Path,
    on_output: Callable[[str], None] | None,
    cancel: Callable[[], bool] | None,
) -> int:
    """Pull mode in this allocation: the srun step the sbatch script starts, run from here; its exit code.

    The vars go to a 0600 file in the private dir; the barrier token is the step's environment only (never argv).
    """
    if not nodes:
        raise SlurmMultiError(
            "pull mode runs inside a SLURM allocation (salloc or sbatch): SLURM_JOB_NODELIST is unset"
        )
    vars_file = private_dir / "vars.json"
    vars_file.unlink(missing_ok=True)  # a sweep's earlier model's (our own private dir): each run writes its own
    write_job_vars(vars_file, job_vars)
    env = without_secrets(os.environ)
    env.update(
        _ansible_env(root),
        PYTHONUNBUFFERED="1",
        MAD_BARRIER_TOKEN=os.environ.get("MAD_BARRIER_TOKEN") or token_hex(24),
        SLURM_MULTI_JOB_END=squeue_job_end(os.environ.get("SLURM_JOB_ID", "")),
        SLURM_MULTI_JOB_START=squeue_job_start(os.environ.get("SLURM_JOB_ID", "")),
    )
    argv = pull_step_argv(find_ansible_playbook(), root / "playbooks", vars_file, len(nodes))
    step = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    stopping = False
    with selectors.DefaultSelector() as selector:
        selector.register(step.stdout, selectors.EVENT_READ)
        while True:
            if selector.select(timeout=0.5):
                line = step.stdout.readline()
                if not line:
                    break
                (on_output or print)(line.rstrip("\n"))
            if cancel is not None and not stopping and cancel():
                stopping = True
                # As the sbatch script does: TERM to the job's steps through SLURM (srun itself would SIGKILL them).
                subprocess.run(["scancel", "--signal=TERM", os.environ.get("SLURM_JOB_ID", "")], check=False)
    return step.wait()


# collect.yml after the pipeline (or again later): its verdict is data here, so a non-zero exit means that
# collecting itself failed.
_COLLECT_ONLY = {"postprocessing_fail_on_failure": False}


def run(
    spec: JobSpec,
    *,
    job_id: str | None = None,
    forks: int | None = None,
    on_event: Callable[[dict], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    root: Path | None = None,
    quiet: bool = True,
    on_output: Callable[[str], None] | None = None,
) -> RunResult:
    """Run the pipeline (run_multi.yml, then collect.yml whatever happened) in this allocation; return its result.

    Push mode runs run_multi.yml here through ansible-runner (``on_event`` gets its events); pull mode starts the
    pull step, whose output lines go to ``on_output``. Outside an allocation it is a one-node run on localhost.
    ``job_id`` defaults to ``SLURM_JOB_ID`` (else ``local-<time>``); a job that already has a record is refused.
    """
    root = content_root(root)
    nodes = allocation_nodes(os.environ)
    try:
        job_id = job_layout.job_id_for_run(job_id or os.environ.get("SLURM_JOB_ID"))
        # A requeued job keeps its ID: this run is its attempt SLURM_RESTART_COUNT, recorded on its own.
        attempt = job_layout.attempt_from_env(os.environ)
        existing = load_record(str(spec.results_dir), job_id, attempt)
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    if existing is not None:
        raise SlurmMultiError(
            f"job {job_id} attempt {attempt} already has a record "
            f"({record_path(str(spec.results_dir), job_id, attempt)}): its results are final. For another run "
            f"in the same allocation give it its own ID, e.g. --job-id {job_id}.2"
        )
    secrets = user_secrets(os.environ)
    private_dir = new_private_dir() if secrets or spec.credentials_file or spec.mode == PULL else None
    try:
        secrets_file = write_secrets_file(private_dir, secrets) if secrets else None
        credentials_copy = None
        if spec.credentials_file:
            credentials_copy = write_credentials_copy(private_dir, spec.credentials_file, spec.login_registry)
        job_vars = spec.job_vars(secrets_file, credentials_copy)

        def run_once(run_vars: Mapping[str, Any]) -> int:
            """One pipeline run (the job's, or a sweep's model's: its job_id in ``run_vars``), collected."""
            run_id = run_vars["job_id"]
            if spec.mode == PULL:
                rc = _run_pull_step(dict(job_vars, **run_vars), nodes, private_dir, root, on_output, cancel)
            else:
                rc = run_playbook(
                    "run_multi.yml",
                    dict(job_vars, **run_vars),
                    forks=forks or max(len(nodes), 1),
                    on_event=on_event,
                    cancel=cancel,
                    root=root,
                    quiet=quiet,
                )
            # The pipeline's own postprocessing wrote the record unless the run was cut short: collect only then.
            if load_record(str(spec.results_dir), run_id, attempt) is None:
                collect_vars = dict(job_vars, collect_job_id=run_id, collect_attempt=attempt, collect_nodes=nodes)
                collect_vars.update(run_vars, **_COLLECT_ONLY)
                run_playbook("collect.yml", collect_vars, on_event=on_event, root=root, quiet=quiet)
            return rc

        if spec.sweep:
            record = run_sweep(
                str(spec.results_dir),
                job_id,
                attempt,
                spec.sweep,
                lambda _model, run_vars: run_once(run_vars),
                stop_on_failure=spec.stop_on_failure,
                nodes=nodes,
                on_progress=on_output or print,
                stopped=lambda: "not run: the run was stopped" if cancel is not None and cancel() else None,
                manifest=str(spec.manifest_path) if spec.manifest_path else None,
            )
            rc = 0 if record.get("status") in ("SUCCESS", "SKIPPED") else 1
        else:
            rc = run_once({"job_id": job_id})
    except SecretsError as exc:
        raise SlurmMultiError(str(exc)) from None
    finally:
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)
    missing = f"the pipeline ended (exit code {rc}) without writing the job's record; its output above says why"
    return job_result(spec.results_dir, job_id, rc, missing, attempt=attempt)


def collect(
    job_id: str,
    results_dir: str | Path | None = None,
    *,
    attempt: int | None = None,
    on_event: Callable[[dict], None] | None = None,
    root: Path | None = None,
    quiet: bool = True,
) -> RunResult:
    """Re-run postprocessing (collect.yml) for a job's attempt; its record, once written, stays as it is.

    ``attempt`` (SLURM_RESTART_COUNT of the run) defaults to the job's last attempt on disk.
    """
    results_dir = Path(results_dir or default_results_dir()).expanduser().absolute()
    try:
        job_id = job_layout.validate_job_id(job_id)
        if attempt is None:
            attempt = job_layout.latest_attempt(str(results_dir), job_id)
        else:
            attempt = job_layout.validate_attempt(attempt)
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    if not (results_dir / job_id).is_dir() and load_record(str(results_dir), job_id) is None:
        raise SlurmMultiError(
            f"job {job_id} has neither results ({results_dir / job_id}) nor a record in {results_dir}"
        )
    collect_vars = dict(_COLLECT_ONLY, results_dir=str(results_dir), collect_job_id=job_id, collect_attempt=attempt)
    rc = run_playbook("collect.yml", dict(collect_vars, collect_nodes=[]), on_event=on_event, root=root, quiet=quiet)
    return job_result(
        results_dir, job_id, attempt=attempt, missing_reason=f"collect.yml ended (exit code {rc}) without a record"
    )
