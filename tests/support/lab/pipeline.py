"""Run the real pipeline (ansible-playbook playbooks/run_multi.yml) on the lab cluster inside `salloc`."""

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurm_multi.submission.sbatch import SlurmOptions, find_ansible_playbook, render_job_script
from tests.support.ansible import BIN, ROOT, ansible_env, run_ansible

# The mode every lab test runs in; tests/conftest.py runs each lab test once per mode (SLURM_MULTI_MODE).
MODE_ENV = "SLURM_MULTI_MODE"


@dataclass
class PipelineRun:
    rc: int
    output: str
    results_dir: Path

    @property
    def job_dirs(self):
        return sorted(p for p in self.results_dir.iterdir() if p.is_dir() and p.name not in ("records",))

    @property
    def job_dir(self) -> Path:
        (job,) = self.job_dirs
        return job

    @property
    def attempt_dir(self) -> Path:
        """The job's first (and, without a requeue, only) attempt."""
        return self.job_dir / "attempt-0"

    @property
    def record(self) -> dict:
        return json.loads((self.results_dir / "records" / f"{self.job_dir.name}.json").read_text())

    def status(self, node: str) -> dict:
        return json.loads((self.attempt_dir / "nodes" / node / "status.json").read_text())


def run_pipeline(
    results_dir: Path, nodes: int = 3, env=None, nodelist: str = "", mode: str | None = None, **extra_vars
) -> PipelineRun:
    """One full run_multi.yml on `nodes` lab nodes (exactly `nodelist` when given: a fault test breaking one node
    needs it in the job, and SLURM may pick node4 over a busy node1), in `mode` (default: the test's, from
    SLURM_MULTI_MODE); extra vars are passed as JSON (data, never templates)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    results_dir.chmod(0o755)
    variables = {"results_dir": str(results_dir), **extra_vars}
    vars_file = results_dir.parent / f"{results_dir.name}.vars.json"
    vars_file.write_text(json.dumps(variables))
    env = dict(env or ansible_env())
    mode = mode or env.get(MODE_ENV)
    if mode:
        env[MODE_ENV] = mode
    if mode == "pull":
        return _run_pull_job_script(results_dir, vars_file, nodes, env, nodelist)
    result = run_ansible(
        ["ansible-playbook", "playbooks/run_multi.yml", "-f", str(nodes), "-e", f"@{vars_file}"],
        nodes=nodes,
        nodelist=nodelist,
        env=env,
        timeout=900,
    )
    return PipelineRun(result.returncode, result.stdout + result.stderr, results_dir)


def run_pipelines_in_one_allocation(results_dir: Path, runs: list, nodelist: str = "node[1-3]") -> tuple:
    """run_multi.yml once per entry of `runs` (each its extra vars), one after the other in one `salloc` (push
    mode), as an engineer iterating in one allocation does; (the whole output, each run's exit code)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    results_dir.chmod(0o755)
    commands = []
    for index, extra_vars in enumerate(runs):
        vars_file = results_dir.parent / f"{results_dir.name}.run{index}.vars.json"
        vars_file.write_text(json.dumps({"results_dir": str(results_dir), **extra_vars}))
        commands.append(
            f'{BIN / "ansible-playbook"} playbooks/run_multi.yml -f 3 -e @{vars_file}; echo "run {index} exit: $?"'
        )
    env = dict(ansible_env(), **{MODE_ENV: "push"})
    result = subprocess.run(
        ["salloc", "-N", "3", "-w", nodelist, "--quiet", "bash", "-c", "; ".join(commands)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    codes = [int(output.split(f"run {index} exit: ")[1].split()[0]) for index in range(len(runs))]
    return output, codes


def _run_pull_job_script(results_dir: Path, vars_file: Path, nodes: int, env, nodelist: str = "") -> PipelineRun:
    """Pull mode as the job runs it: the real sbatch script (its pull step, then collect), in `salloc`."""
    script = results_dir.parent / f"{results_dir.name}.job.sbatch"
    script.write_text(
        render_job_script(
            SlurmOptions(nodes=nodes),
            ROOT,
            find_ansible_playbook(),  # the job script's own: slurm-multi-playbook
            vars_file,
            results_dir.parent,
            results_dir,
            "pull",
        )
    )
    result = subprocess.run(
        ["salloc", "-N", str(nodes), *(["-w", nodelist] if nodelist else []), "--quiet", "bash", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return PipelineRun(result.returncode, result.stdout + result.stderr, results_dir)
