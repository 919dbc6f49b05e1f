"""The run_model, container_diagnostics and stale_containers modules, run as Ansible runs them on a node.

Each module runs in its own python process with its JSON arguments, as a pipelined srun step would run it,
against the session's private Docker daemon.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.ansible import ansible_env, run_ansible
from tests.support.dockerd import job_leaving_no_containers

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent

# The module as a node's python runs it: module_utils from the venv's install of the package, args from a file.
_MODULE_MAIN = (
    "import runpy, sys\n"
    "module_path = sys.argv[1]\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(module_path, run_name='__main__')\n"
)


def start_module(name, args, env, tmp_path, check_mode=False):
    """Start library/<name>.py in a subprocess; returns the Popen (stdout carries the module's JSON result)."""
    args_file = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check_mode}}))
    return subprocess.Popen(
        [sys.executable, "-c", _MODULE_MAIN, str(ROOT / "library" / f"{name}.py"), str(args_file)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_module(name, args, env, tmp_path, check_mode=False, timeout=60):
    """Run library/<name>.py to its end and return its JSON result."""
    process = start_module(name, args, env, tmp_path, check_mode)
    stdout, stderr = process.communicate(timeout=timeout)
    assert stdout.strip(), f"{name} printed no result; stderr: {stderr[-2000:]}"
    return json.loads(stdout)


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "perf.sh").write_text("echo 'performance: 42 samples_per_second'\n")
    (directory / "crash.sh").write_text("echo 'RuntimeError: boom'\nexit 2\n")
    (directory / "hang.sh").write_text("echo 'waiting in allreduce'\nsleep 1000\n")
    return directory


@pytest.fixture
def job_id(private_dockerd):
    """A fresh job ID; afterwards no container of that job may be left on the daemon."""
    with job_leaving_no_containers(private_dockerd, "m") as job:
        yield job


@pytest.fixture
def run_args(busybox_image, model_dir, tmp_path, job_id):
    return dict(
        job_id=job_id,
        rank=0,
        nnodes=1,
        node="node0",
        model="dummy",
        image=busybox_image[0],
        model_dir=str(model_dir),
        script="perf.sh",
        results_dir=str(tmp_path / "results"),
        master_addr="127.0.0.1",
        master_port=29500,
        user="tester",
        stop_grace=1,
    )


def _node_dir(tmp_path, job_id):
    return tmp_path / "results" / job_id / "attempt-0" / "nodes" / "node0"


def test_a_successful_run_reports_its_status_and_changed(run_args, private_dockerd, tmp_path):
    result = run_module("run_model", run_args, private_dockerd.env, tmp_path)

    assert result.get("failed") is not True, result
    assert result["changed"] is True
    assert result["status"]["status"] == "SUCCESS" and result["status"]["perf_lines"] == 1
    assert json.loads(Path(result["status_path"]).read_text()) == result["status"]


def test_a_model_failure_is_a_successful_task_with_a_failure_status(run_args, private_dockerd, tmp_path):
    result = run_module("run_model", {**run_args, "script": "crash.sh"}, private_dockerd.env, tmp_path)

    assert result.get("failed") is not True, result
    assert result["status"]["status"] == "FAILURE" and result["status"]["exit_code"] == 2
    assert Path(result["diagnostics_path"]).is_file()


def test_a_missing_image_fails_the_task_with_what_to_fix(run_args, private_dockerd, tmp_path):
    result = run_module("run_model", {**run_args, "image": "slurm-multi-test/absent:1"}, private_dockerd.env, tmp_path)

    assert result["failed"] is True
    assert "slurm-multi-test/absent:1 is not on node0's docker daemon" in result["msg"]


def test_scripts_are_copied_into_the_model_dir_and_run_from_there(run_args, private_dockerd, model_dir, tmp_path):
    """The card's `scripts` file: its whole directory is copied into the node's own workspace, and it runs there."""
    workspace = tmp_path / "results" / "workspace"
    args = {key: value for key, value in run_args.items() if key != "script"}
    result = run_module(
        "run_model",
        {**args, "scripts": str(model_dir / "perf.sh"), "model_dir": str(workspace)},
        private_dockerd.env,
        tmp_path,
    )

    assert result.get("failed") is not True, result
    assert result["status"]["status"] == "SUCCESS" and result["status"]["perf_lines"] == 1
    assert sorted(os.listdir(workspace)) == sorted(os.listdir(model_dir))
    assert result["docker_run_argv"][-1] == "perf.sh"


def test_missing_scripts_fail_the_task_naming_the_path_and_start_nothing(run_args, private_dockerd, tmp_path):
    args = {key: value for key, value in run_args.items() if key != "script"}
    missing = tmp_path / "zoo" / "scripts" / "absent"
    result = run_module("run_model", {**args, "scripts": str(missing)}, private_dockerd.env, tmp_path)

    assert result["failed"] is True
    assert f"the model's scripts {missing} do not exist" in result["msg"] and "`scripts`" in result["msg"]
    assert not (tmp_path / "results").exists()


def test_script_and_scripts_together_are_refused(run_args, private_dockerd, model_dir, tmp_path):
    result = run_module("run_model", {**run_args, "scripts": str(model_dir)}, private_dockerd.env, tmp_path)

    assert result["failed"] is True and "mutually exclusive: script|scripts" in result["msg"]


def test_check_mode_reports_the_docker_argv_and_starts_nothing(run_args, private_dockerd, tmp_path, job_id):
    secrets = tmp_path / "secrets.env"
    secrets.write_text("MAD_SECRETS_HFTOKEN=hf_check_mode_value\n")
    secrets.chmod(0o600)

    result = run_module(
        "run_model",
        {**run_args, "secrets_file": str(secrets), "model_args": "--steps 3"},
        private_dockerd.env,
        tmp_path,
        check_mode=True,
    )

    assert result["changed"] is True and "status" not in result
    assert result["docker_run_argv"][-3:] == ["perf.sh", "--steps", "3"]
    assert result["env_file_variables"] == ["MAD_SECRETS_HFTOKEN"]
    assert "hf_check_mode_value" not in json.dumps(result)
    assert not (tmp_path / "results").exists()


def test_the_contexts_guest_os_reaches_the_container_as_mad_guest_os(run_args, private_dockerd, tmp_path):
    # The run stage passes the context's guest_os (roles/running); madengine sets it as MAD_GUEST_OS.
    given = run_module("run_model", {**run_args, "guest_os": "centos"}, private_dockerd.env, tmp_path, check_mode=True)
    default = run_module("run_model", run_args, private_dockerd.env, tmp_path, check_mode=True)

    assert "MAD_GUEST_OS=CENTOS" in given["docker_run_argv"]
    assert "MAD_GUEST_OS=UBUNTU" in default["docker_run_argv"]


def test_a_secrets_file_others_can_read_fails_the_task(run_args, private_dockerd, tmp_path):
    secrets = tmp_path / "secrets.env"
    secrets.write_text("MAD_SECRETS_HFTOKEN=hf_leaky_value\n")
    secrets.chmod(0o644)

    result = run_module("run_model", {**run_args, "secrets_file": str(secrets)}, private_dockerd.env, tmp_path)

    assert result["failed"] is True
    assert f"chmod 600 {secrets}" in result["msg"]
    assert "hf_leaky_value" not in json.dumps(result)


def _wait_until_running(dockerd, name, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dockerd.docker("ps", "-q", "--filter", f"name=^{name}$", "--filter", "status=running").stdout.strip():
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never ran")


def test_sigterm_snapshots_stops_records_and_removes_the_container(run_args, private_dockerd, tmp_path, job_id):
    process = start_module("run_model", {**run_args, "script": "hang.sh"}, private_dockerd.env, tmp_path)
    _wait_until_running(private_dockerd, f"slurm-multi-{job_id}-r0")

    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    stdout, _ = process.communicate(timeout=30)
    took = time.monotonic() - signalled

    result = json.loads(stdout)
    assert result["failed"] is True and "cancelled by SIGTERM" in result["msg"]
    status = json.loads((_node_dir(tmp_path, job_id) / "status.json").read_text())
    assert (status["status"], status["cancelled"]) == ("FAILURE", True)
    diagnostics = (_node_dir(tmp_path, job_id) / "diagnostics.txt").read_text()
    assert "== process table" in diagnostics and "sleep 1000" in diagnostics
    assert private_dockerd.docker("ps", "-a", "-q", "--filter", f"label=slurm-multi.job={job_id}").stdout == ""
    assert took < 25, f"the module took {took:.1f} s after SIGTERM; SLURM kills it at 30 s"


def test_a_worker_whose_rank0_heartbeat_stood_still_stops_naming_rank0(run_args, private_dockerd, tmp_path, job_id):
    """Pull mode: rank 0's playbook was killed (its heartbeat stands still, it wrote no status.json)."""
    rank0_dir = tmp_path / "results" / job_id / "attempt-0" / "nodes" / "gpu01"
    rank0_dir.mkdir(parents=True)
    (rank0_dir / "playbook.alive").write_text("4242 1733150000.5\n")
    worker = dict(run_args, rank=1, nnodes=2, script="hang.sh", allocation_nodes=["gpu01", "node0"])
    started = time.monotonic()

    result = run_module("run_model", dict(worker, heartbeat_stale=1), private_dockerd.env, tmp_path)

    assert result.get("failed") is not True, result
    assert (result["status"]["status"], result["status"]["aborted_by_rank"]) == ("FAILURE", 0), result["status"]
    assert result["status"]["reason"].startswith("rank 0 (gpu01)'s playbook stopped its heartbeat"), result["status"]
    assert time.monotonic() - started < 20  # hang.sh sleeps 1000 s
    refused = run_module("run_model", dict(worker, heartbeat_stale=-1), private_dockerd.env, tmp_path)
    assert refused["failed"] is True and "heartbeat_stale must be 0 (off) or a positive" in refused["msg"], refused


def test_the_diagnostics_module_writes_its_snapshot(private_dockerd, busybox_image, tmp_path):
    name = f"diag-{uuid.uuid4().hex[:8]}"
    private_dockerd.docker("run", "--name", name, busybox_image[0], "sh", "-c", "echo last words; exit 9", check=False)
    try:
        result = run_module(
            "container_diagnostics",
            {"container": name, "dest": str(tmp_path / "diagnostics.txt")},
            private_dockerd.env,
            tmp_path,
        )
    finally:
        private_dockerd.docker("rm", "-f", name, check=False)

    assert result["changed"] is True
    assert "ExitCode: 9" in (tmp_path / "diagnostics.txt").read_text()
    assert "last words" in result["diagnostics"]


def test_the_stale_containers_module_removes_containers_whose_owner_is_gone(private_dockerd, busybox_image, tmp_path):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import owner_labels

    owner = subprocess.Popen(["true"])
    owner.wait()  # a run outside SLURM whose run module is gone
    name = f"slurm-multi-local-{uuid.uuid4().hex[:8]}-r0"
    labels = {
        "slurm-multi.job": "local-1",
        "slurm-multi.user": "tester",
        **owner_labels({}, pid=owner.pid),
        "slurm-multi.pid_start": "1",
    }
    private_dockerd.docker(
        "create", "--name", name, *[f"--label={k}={v}" for k, v in labels.items()], busybox_image[0], "true"
    )
    try:
        result = run_module("stale_containers", {"user": "tester"}, private_dockerd.env, tmp_path)
        left = private_dockerd.docker("ps", "-a", "-q", "--filter", f"name=^{name}$").stdout
    finally:
        private_dockerd.docker("rm", "-f", name, check=False)

    assert result["changed"] is True and name in result["removed"]
    assert f"pid {owner.pid}" in result["reasons"][name]
    assert left == ""


def test_ansible_runs_the_module_with_its_module_utils_in_check_mode(run_args, private_dockerd, job_id):
    completed = run_ansible(
        [
            "ansible",
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-C",
            "-m",
            "run_model",
            "-a",
            json.dumps({**run_args, "model_args": "$(id) `id` ;id"}),
            "-e",
            f"ansible_python_interpreter={sys.executable}",
        ],
        env=ansible_env(
            DOCKER_HOST=private_dockerd.host,
            ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
            ANSIBLE_STDOUT_CALLBACK="minimal",
            ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ),
        timeout=120,
    )

    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.split(" => ", 1)[1])
    assert result["container"] == f"slurm-multi-{job_id}-r0"
    assert result["docker_run_argv"][-4:] == ["perf.sh", "$(id)", "`id`", ";id"]
