"""`slurm-multi submit` on the lab cluster, with stand-in pipelines: what needs no working pipeline.

A stand-in content root (SLURM_MULTI_HOME) links the real ansible.cfg, inventory, plugins, modules and group_vars
and brings its own small run_multi.yml / collect.yml, so that these tests check the submit side: the dry run,
the secrets file and the job's environment, the afterany collect job, the early-warning trap, `--wait`. The
secrets are also followed through one real submission (the real roles and a real model), and through a
submission that sbatch refuses.
"""

import hashlib
import json
import re
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import hostlist
import pytest

from slurm_multi.submission import sbatch
from slurm_multi.submission.job_vars import unmark_unsafe
from slurm_multi.submission.submit import forget_secrets_of_forgotten_jobs
from tests.integration.run.test_pipeline_security_lab import _zoo_with_probe, docker_state_holding, files_holding
from tests.support.ansible import ROOT, ansible_env
from tests.support.lab.per_mode_jobs import once_per_mode

# lab_serial: its jobs are exclusive (submit's default) and must start within a bound: another test's jobs on the
# same nodes would hold them back.
pytestmark = [pytest.mark.lab, pytest.mark.lab_serial]

LINKED = (
    "ansible.cfg",
    "inventory",
    "collections",
    "plugins",
    "library",
    "module_utils",
    "roles",
    "group_vars",
    "models",
)

# The stand-ins run where the pipeline's Ansible runs: push mode, the batch host; pull mode, every node (each in
# its own play over its own node: hence primary:workers, once, on the machine that runs the play).
ENV_PROBE = """\
- name: Stand-in pipeline that shows the job's environments
  hosts: primary:workers
  gather_facts: false
  tasks:
    - name: Write the environment Ansible runs in and another node's environment
      run_once: true
      delegate_to: localhost
      ansible.builtin.shell: |
        mkdir -p "{{ results_dir }}/probe"
        env > "{{ results_dir }}/probe/batch.env"
        srun --overlap -N1 -n1 -w "{{ groups['workers'][0] }}" env > "{{ results_dir }}/probe/step.env"
        cp "{{ secrets_file }}" "{{ results_dir }}/probe/secrets.copy"
"""

SLEEPER = """\
- name: Stand-in pipeline that runs until it is stopped
  hosts: primary:workers
  gather_facts: false
  tasks:
    - name: Say the run started
      run_once: true
      delegate_to: localhost
      ansible.builtin.shell: mkdir -p "{{ results_dir }}/probe" && date > "{{ results_dir }}/probe/started"

    - name: Wait like a long model run
      run_once: true
      delegate_to: localhost
      ansible.builtin.command: sleep 600
"""

SUCCESSFUL_RUN = """\
- name: Stand-in pipeline whose nodes all succeed; the last rank prints the figure
  hosts: primary:workers
  gather_facts: false
  tasks:
    - name: Write each node's results as the run stage does
      ansible.builtin.shell: |
        dir="{{ results_dir | slurm_multi.pipeline.node_results_dir(slurm_job_id, attempt, inventory_hostname) }}"
        mkdir -p "$dir"
        if [ {{ node_rank }} -eq {{ nnodes - 1 }} ]; then echo "performance: 1234.5 tokens/sec" > "$dir/run.log"; fi
        echo '{"node": "{{ inventory_hostname }}", "rank": {{ node_rank }}, "status": "SUCCESS", "exit_code": 0,
               "perf_lines": {{ 1 if node_rank == nnodes - 1 else 0 }}, "reason": ""}' > "$dir/status.json"
      delegate_to: localhost
      vars:
        attempt: "{{ lookup('env', 'SLURM_RESTART_COUNT') | default('0', true) }}"
"""

COLLECT_MARKER = """\
- name: Stand-in postprocessing that only leaves a marker
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Leave the marker
      ansible.builtin.shell: mkdir -p "{{ results_dir }}/probe" && date > "{{ results_dir }}/probe/collected"
"""

COLLECT_RECORD = """\
- name: Stand-in postprocessing with the real collect_results module
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Collect
      collect_results:
        results_dir: "{{ results_dir }}"
        job_id: "{{ lookup('env', 'SLURM_JOB_ID') }}"
        model: {name: dummy}
        nodes: "{{ groups['primary'] + groups['workers'] }}"
"""


def _stand_in_root(base: Path, run_multi: str, collect: str) -> Path:
    root = base / "content"
    (root / "playbooks").mkdir(parents=True)
    for name in LINKED:
        (root / name).symlink_to(ROOT / name)
    (root / "playbooks" / "group_vars").symlink_to(ROOT / "group_vars")
    (root / "playbooks" / "run_multi.yml").write_text(run_multi)
    (root / "playbooks" / "collect.yml").write_text(collect)
    return root


def _cli_env(tmp_path, extra_env=None) -> dict:
    """The CLI's environment for a test: HOME under `tmp_path` (made here), no results dir from the caller's."""
    env = ansible_env(HOME=str(tmp_path / "home"), **(extra_env or {}))
    env.pop("SLURM_MULTI_RESULTS_DIR", None)
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def _cli(args, tmp_path, root=None, extra_env=None, timeout=120):
    env = _cli_env(tmp_path, extra_env)
    if root:
        env["SLURM_MULTI_HOME"] = str(root)
    return subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _submit(tmp_path, root, *args, extra_env=None):
    result = _cli(
        ["submit", "-N", "3", "--tags", "dummy", "--results-dir", str(tmp_path / "results"), *args],
        tmp_path,
        root,
        extra_env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.split("Submitted job ")[1].split()[0]
    collect_id = result.stdout.split("its collect job: ")[1].split(")")[0]
    return job_id, collect_id


def _job_state(job_id):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return next((word.split("=", 1)[1] for word in out.split() if word.startswith("JobState=")), None)


def _wait_until_ended(job_id, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _job_state(job_id) not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            return _job_state(job_id)
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {_job_state(job_id)} after {timeout} s")


def _wait_for(path: Path, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.5)


def _private_dir(tmp_path):
    (private,) = (tmp_path / "home" / ".slurm-multi" / "jobs").iterdir()
    return private


# No job is submitted, so no pipeline runs in either mode: once, not per mode.
@pytest.mark.mode_independent
def test_a_dry_run_submits_nothing(lab_cluster, tmp_path):
    result = _cli(["submit", "--dry-run", "-N", "3", "--tags", "dummy", "--results-dir", str(tmp_path / "r")], tmp_path)
    assert result.returncode == 0, result.stderr
    known_jobs = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in known_jobs  # no job, pending, running or ended, came from this test's HOME
    assert not (tmp_path / "home" / ".slurm-multi").exists()


@pytest.fixture(scope="module")
def job_with_a_secret(lab_cluster, tmp_path_factory):
    """mode -> a 3-node job submitted with MAD_SECRETS_HFTOKEN set, whose stand-in pipeline dumps its environments:
    (base dir, secret, job ID)."""

    def submit(mode):
        base = tmp_path_factory.mktemp(f"secret-job-{mode}")
        secret = f"hf_{uuid.uuid4().hex}"
        root = _stand_in_root(base, ENV_PROBE, COLLECT_MARKER)
        job_id, collect_id = _submit(base, root, extra_env={"MAD_SECRETS_HFTOKEN": secret})
        _wait_until_ended(job_id)
        _wait_until_ended(collect_id)
        return base, secret, job_id

    return once_per_mode(submit, output=lambda made: _job_output(made[0], made[2]))


def _job_output(base, job_id):
    """The job's own output: its Ansible output, in its private dir."""
    return (_private_dir(base) / f"slurm-{job_id}.out").read_text()


def test_the_secrets_file_is_0600_in_a_0700_private_dir_and_named_in_the_vars(job_with_a_secret, pipeline_mode):
    base, secret, _ = job_with_a_secret(pipeline_mode)
    private = _private_dir(base)
    job_vars = json.loads((private / "vars.json").read_text())
    assert job_vars["secrets_file"] == {"__ansible_unsafe": str(private / "secrets.env")}
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE((private / "vars.json").stat().st_mode) == 0o600
    assert (base / "results" / "probe" / "secrets.copy").read_text() == f"MAD_SECRETS_HFTOKEN={secret}\n"


def test_the_secret_is_in_no_job_environment_script_vars_or_output(job_with_a_secret, pipeline_mode):
    base, secret, job_id = job_with_a_secret(pipeline_mode)
    private = _private_dir(base)
    probe = base / "results" / "probe"
    assert "SLURM_JOB_ID=" in (probe / "batch.env").read_text()
    assert "SLURM_STEP_ID=" in (probe / "step.env").read_text()
    for path in (
        probe / "batch.env",
        probe / "step.env",
        private / "job.sbatch",
        private / "collect.sbatch",
        private / "vars.json",
        private / f"slurm-{job_id}.out",
    ):
        assert secret not in path.read_text(), path
    script = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True)
    assert secret not in script.stdout + script.stderr


def test_the_secrets_file_stays_for_a_requeue_until_slurm_forgets_the_job(
    job_with_a_secret, pipeline_mode, monkeypatch
):
    base, secret, job_id = job_with_a_secret(pipeline_mode)
    kept = _private_dir(base) / "secrets.env"
    # The job has ended and its collect job ran, but SLURM remembers it: `scontrol requeue` can still run it again.
    assert kept.read_text() == f"MAD_SECRETS_HFTOKEN={secret}\n" and stat.S_IMODE(kept.stat().st_mode) == 0o600
    monkeypatch.setenv("HOME", str(base / "home"))
    assert forget_secrets_of_forgotten_jobs() == []
    # A submission whose jobs SLURM has forgotten (no such IDs): its files go, and nothing else of its dir.
    forgotten = kept.parent.parent / "20260101-000000-forgotten"
    forgotten.mkdir(mode=0o700)
    (forgotten / "submission.json").write_text(json.dumps({"job_id": "987654321", "collect_job_id": "987654322"}))
    for name in ("secrets.env", "credential.json", "vars.json"):
        (forgotten / name).write_text("x")
    assert forget_secrets_of_forgotten_jobs() == [forgotten / "secrets.env", forgotten / "credential.json"]
    assert sorted(path.name for path in forgotten.iterdir()) == ["submission.json", "vars.json"]
    assert kept.exists()


def test_a_cancelled_job_gets_a_failure_record_with_slurms_state(lab_cluster, tmp_path):
    root = _stand_in_root(tmp_path, SLEEPER, COLLECT_MARKER)
    job_id, collect_id = _submit(tmp_path, root)
    deadline = time.monotonic() + 120
    while _job_state(job_id) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} never started"
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=True)
    assert _wait_until_ended(collect_id) == "COMPLETED"
    record = json.loads((tmp_path / "results" / "records" / f"{job_id}.json").read_text())
    assert (record["status"], record["slurm_state"]) == ("FAILURE", "CANCELLED")
    assert "the job ended without writing its record" in record["reason"]
    perf_csv = (tmp_path / "results" / "perf.csv").read_text()
    assert "dummy" in perf_csv and "FAILURE" in perf_csv


def test_the_early_warning_stops_the_pipeline_and_collects_before_the_limit(lab_cluster, tmp_path):
    root = _stand_in_root(tmp_path, SLEEPER, COLLECT_MARKER)
    job_id, _ = _submit(tmp_path, root)
    _wait_for(tmp_path / "results" / "probe" / "started")
    # What sbatch --signal=B:USR1@<s> does ahead of the time limit.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
    assert _wait_until_ended(job_id, timeout=120) == "FAILED"
    assert (tmp_path / "results" / "probe" / "collected").exists()
    output = _private_dir(tmp_path) / f"slurm-{job_id}.out"
    assert "early warning (SIGUSR1)" in output.read_text()


def test_submit_wait_follows_the_job_and_exits_with_its_verdict(lab_cluster, tmp_path, pipeline_mode):
    root = _stand_in_root(tmp_path, SUCCESSFUL_RUN, COLLECT_RECORD)
    result = _cli(
        ["submit", "-N", "3", "--tags", "dummy", "--results-dir", str(tmp_path / "results"), "--wait"],
        tmp_path,
        root,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Where it ran: on RUNNING, or on the state it was next seen in when the stand-in job ended between two polls;
    # any three of the lab's nodes (a lab grown by an earlier test has idle nodes beyond node3).
    where = re.search(r"job \d+: [A-Z]+ on (node\S+)$", result.stdout, re.M)
    assert where, result.stdout
    nodes = hostlist.expand_hostlist(where.group(1))
    assert len(nodes) == 3, result.stdout
    task = (
        "[Stand-in pipeline whose nodes all succeed; the last rank prints the figure] "
        "Write each node's results as the run stage does"
    )
    # Push mode: one line per task with every node's outcome; pull mode: each node's own play, a line each.
    outcomes = [f"changed {where.group(1)}"] if pipeline_mode == "push" else [f"changed {node}" for node in nodes]
    for outcome in outcomes:
        assert f"{task}: {outcome}\n" in result.stdout, result.stdout
    assert f"{nodes[-1]}: SUCCESS (exit 0; 1 performance line(s))" in result.stdout
    assert "SUCCESS" in result.stdout and "1234.5" in result.stdout and "tokens/sec" in result.stdout


# sbatch refuses the partition before any job exists, so no pipeline runs in either mode: once, not per mode.
@pytest.mark.mode_independent
def test_a_submission_sbatch_refuses_leaves_no_secrets_file(lab_cluster, tmp_path):
    secret = f"hf_{uuid.uuid4().hex}"
    result = _cli(
        [
            "submit",
            "-N",
            "3",
            "--tags",
            "dummy",
            "--results-dir",
            str(tmp_path / "results"),
            "--partition",
            "no_such_partition",
        ],
        tmp_path,
        extra_env={"MAD_SECRETS_HFTOKEN": secret},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "invalid partition" in result.stderr.lower(), result.stderr
    assert list((tmp_path / "home").rglob("secrets.env")) == []
    assert files_holding(secret, tmp_path) == []


def test_a_secret_through_a_real_submission_reaches_the_container_and_no_output(lab_cluster, tmp_path):
    """The real roles, not a stand-in: submit --wait of a real model, then every output is searched."""
    secret = f"hf_{uuid.uuid4().hex}"
    models_file = _zoo_with_probe(tmp_path, "--steps 4")
    context = json.dumps({"docker_env_vars": {"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}", "OMP_NUM_THREADS": "4"}})
    result = _cli(
        [
            "submit",
            "-N",
            "3",
            "--no-exclusive",
            "--tags",
            "secret_probe",
            "--models-file",
            str(models_file),
            "--results-dir",
            str(tmp_path / "results"),
            "-c",
            context,
            "--wait",
        ],
        tmp_path,
        extra_env={"MAD_SECRETS_HFTOKEN": secret},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.split("Submitted job ")[1].split()[0]
    collect_id = result.stdout.split("its collect job: ")[1].split(")")[0]
    assert _wait_until_ended(collect_id) == "COMPLETED"

    assert "SUCCESS" in result.stdout and "4200" in result.stdout
    log = next((tmp_path / "results").rglob("nodes/node2/run.log")).read_text()
    assert f"hf-token-md5 {hashlib.md5(secret.encode()).hexdigest()}" in log
    assert "secret as printed: ********" in log and "OMP_NUM_THREADS=4" in log
    # Everywhere a secret could land: the CLI's output, the job's private dir (scripts, vars, its Ansible output),
    # the results dir, the zoo, SLURM's copy of the batch script, every container and image on every node.
    assert secret not in result.stdout + result.stderr
    # Only the job's own 0600 secrets file, kept while SLURM remembers the job (a requeue reads it).
    (kept,) = (tmp_path / "home").rglob("secrets.env")
    assert files_holding(secret, tmp_path) == [str(kept)]
    script = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True)
    assert secret not in script.stdout + script.stderr
    assert docker_state_holding(secret) == []


def test_a_config_files_slurm_section_is_what_slurm_holds_and_what_the_dry_run_shows(lab_cluster, tmp_path):
    config = tmp_path / "deploy.json"
    config.write_text(
        json.dumps(
            {
                "_comment": "a madengine deployment config",
                "gpu_vendor": "AMD",
                "slurm": {
                    "nodes": 2,
                    "time": "00:09:00",
                    "exclusive": False,
                    "output_dir": "./slurm_output",
                    "node_selector": {"partition": "lab", "exclude": "node3"},
                },
            }
        )
    )
    args = ["submit", "--tags", "dummy", "--results-dir", str(tmp_path / "results"), "--config", str(config)]
    args += ["--time", "7"]  # an option over the config's slurm.time
    root = _stand_in_root(tmp_path, COLLECT_MARKER, COLLECT_MARKER)

    dry_run = _cli([*args, "--dry-run"], tmp_path, root)
    result = _cli(args, tmp_path, root)

    assert dry_run.returncode == 0 and result.returncode == 0, dry_run.stderr + result.stdout + result.stderr
    job_id = result.stdout.split("Submitted job ")[1].split()[0]
    collect_id = result.stdout.split("its collect job: ")[1].split(")")[0]
    try:
        info = sbatch.job_info(job_id)
        # A pending job's NumNodes is its range (2-2), a started one's its count.
        assert (info["NumNodes"].split("-")[0], info["TimeLimit"], info["Partition"]) == ("2", "00:07:00", "lab")
        assert info["ExcNodeList"] == "node3" and info["OverSubscribe"] != "NO"  # not exclusive
        # The dry run showed the #SBATCH lines submitted (all but the output path, which names the private dir).
        private = _private_dir(tmp_path)
        submitted = (private / "job.sbatch").read_text()
        shown = dry_run.stdout.split("collect.sbatch")[0]
        assert _sbatch_lines(submitted) == _sbatch_lines(shown)
        assert "#SBATCH --exclude=node3" in _sbatch_lines(shown)
        saved = unmark_unsafe(json.loads((private / "vars.json").read_text()))["additional_context"]
        assert saved["slurm"] == {
            "nodes": 2,
            "time": "7",
            "exclusive": False,
            "output_dir": "./slurm_output",
            "partition": "lab",
            "exclude": "node3",
        }
    finally:
        subprocess.run(["scancel", job_id, collect_id], capture_output=True)


def _sbatch_lines(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH") and "--output=" not in line]
