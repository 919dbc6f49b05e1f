"""Registry mode with MAD's credential.json on the lab: `slurm-multi submit --registry --credentials --wait` against
the lab's registry that asks for a login (docker-registry with htpasswd on 127.0.0.1:17501).

Rank 0 logs in and pushes a fresh image (a new build arg: no node holds it), the workers log in and pull it by
digest, the run succeeds; a wrong password fails the job with a message naming the registry. The password is then
searched for in every output: the CLI's, the job's private dir (scripts, vars, its Ansible output), the results dir
and records, SLURM's copy of the batch script, each node's node-local storage (/dev/shm) and Docker config.
"""

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from slurm_multi.lab import cluster as lab
from tests.integration.run.test_pipeline_security_lab import _on_every_node, files_holding
from tests.support.ansible import ansible_env
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.per_mode_jobs import once_per_mode

pytestmark = pytest.mark.lab

# A repository of this session's own: a run elsewhere on the same lab may move its tags.
REGISTRY = f"{lab.auth_registry_url()}/slurm-multi-lab-test-{uuid.uuid4().hex[:8]}"


def _lab_password() -> str:
    return json.loads(lab.auth_registry_credentials_file().read_text())[lab.auth_registry_url()]["password"]


def _credential_json(directory: Path, password: str) -> Path:
    """A user's credential.json in MAD's format (its other entries too), outside the searched job dirs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "credential.json"
    path.write_text(
        json.dumps(
            {
                lab.auth_registry_url(): {"username": lab.AUTH_REGISTRY_USER, "password": password},
                "MAD_AWS_S3": {"USERNAME": "someone", "PASSWORD": "not-for-registries"},
            }
        )
    )
    path.chmod(0o600)
    return path


def _submit(base: Path, credentials: Path):
    """`slurm-multi submit --wait` of a fresh image in registry mode, HOME and the results under `base`."""
    (base / "home").mkdir(parents=True, exist_ok=True)
    env = ansible_env(HOME=str(base / "home"))
    env.pop("SLURM_MULTI_RESULTS_DIR", None)
    context = json.dumps({"docker_build_arg": {"LAB_TEST_NONCE": uuid.uuid4().hex}})
    argv = ["submit", "-N", "3", "--no-exclusive", "--tags", "dummy", "--registry", REGISTRY]
    argv += ["--credentials", str(credentials), "--results-dir", str(base / "results"), "-c", context, "--wait"]
    result = subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", *argv],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    job_id = result.stdout.split("Submitted job ")[1].split()[0] if "Submitted job " in result.stdout else None
    collect_id = result.stdout.split("its collect job: ")[1].split(")")[0] if job_id else None
    return result, job_id, collect_id


def _wait_until_ended(job_id, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} has not ended after {timeout} s")


def _image_id_on(node, reference):
    result = subprocess.run(
        ["docker", "--host", node_docker_host(node), "image", "inspect", "--format", "{{.Id}}", reference],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def _everywhere_else(password: str, base: Path, job_id: str) -> list:
    """Where `password` is found outside the user's credential.json: files under `base` (HOME with the job's
    private dir and Ansible output, the results and records), SLURM's batch script, the nodes' /dev/shm and their
    Docker configs (~ of the job and root's)."""
    found = [path for path in files_holding(password, base) if not _the_users_or_the_jobs_copy(path, base)]
    script = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True)
    if password in script.stdout + script.stderr:
        found.append("SLURM's batch script")
    nodes = _on_every_node(f"grep -rl -- '{password}' /dev/shm /root/.docker {base / 'home'} 2>/dev/null; true")
    found += [line for line in nodes.splitlines() if line.strip() and not _the_users_or_the_jobs_copy(line, base)]
    return found


def _the_users_or_the_jobs_copy(path: str, base: Path) -> bool:
    """The user's credential.json, or the job's 0600 copy of its entry (kept while the job may be requeued)."""
    return path.startswith(str(base / "user")) or Path(path).match(f"{base}/home/.slurm-multi/jobs/*/credential.json")


@pytest.fixture(scope="module")
def good_job(lab_cluster, tmp_path_factory):
    """mode -> a registry-mode job with the right password: (base dir, password, the CLI's result, job ID)."""

    def submit(mode):
        base = tmp_path_factory.mktemp(f"credentials-job-{mode}")
        password = _lab_password()
        result, job_id, collect_id = _submit(base, _credential_json(base / "user", password))
        if collect_id:
            _wait_until_ended(collect_id)
        return base, password, result, job_id

    return once_per_mode(submit, output=lambda made: _job_output(made[0], made[2], made[3]))


def _job_output(base: Path, result, job_id: str | None) -> str:
    """The job's own output (its Ansible output) in its private dir; the CLI's when nothing was submitted."""
    if job_id is None:
        return result.stdout + result.stderr
    (private,) = (base / "home" / ".slurm-multi" / "jobs").iterdir()
    return (private / f"slurm-{job_id}.out").read_text()


def test_a_registry_run_with_credential_json_succeeds_and_the_workers_pull_rank0s_push_by_digest(
    good_job, pipeline_mode
):
    base, _, result, _ = good_job(pipeline_mode)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SUCCESS" in result.stdout
    (manifest,) = (base / "results").rglob("build_manifest.json")
    entry = next(iter(json.loads(manifest.read_text())["built_images"].values()))
    assert entry["registry_image_by_digest"].startswith(f"{REGISTRY}@sha256:"), entry
    # A fresh image: the workers can hold it only by pulling it, logged in, from the registry.
    for node in ("node1", "node2", "node3"):
        assert _image_id_on(node, entry["registry_image_by_digest"]) == entry["image_id"], node


def test_the_password_of_a_successful_run_appears_nowhere(good_job, pipeline_mode):
    base, password, result, job_id = good_job(pipeline_mode)
    assert password not in result.stdout + result.stderr
    assert _everywhere_else(password, base, job_id) == []


def test_the_jobs_copy_of_the_credentials_stays_0600_for_a_requeue_once_the_job_is_recorded(good_job, pipeline_mode):
    base, password, _, _ = good_job(pipeline_mode)
    (private,) = (base / "home" / ".slurm-multi" / "jobs").iterdir()
    assert (private / "vars.json").exists()
    # SLURM remembers the job, so `scontrol requeue` can run it again: the copy goes once SLURM has forgotten it.
    assert password in (private / "credential.json").read_text()
    assert stat.S_IMODE((private / "credential.json").stat().st_mode) == 0o600


def test_a_wrong_password_fails_the_job_naming_the_registry_and_appears_nowhere(lab_cluster, tmp_path):
    wrong = f"wrong-{uuid.uuid4().hex}"
    result, job_id, collect_id = _submit(tmp_path, _credential_json(tmp_path / "user", wrong))
    assert job_id, result.stdout + result.stderr
    _wait_until_ended(collect_id)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (private,) = (tmp_path / "home" / ".slurm-multi" / "jobs").iterdir()
    output = " ".join((private / f"slurm-{job_id}.out").read_text().split())
    assert f"docker login to registry {lab.auth_registry_url()} as 'lab' failed" in output, output[-3000:]
    assert f"of entry '{lab.auth_registry_url()}' in the credentials file {tmp_path / 'user' / 'credential.json'}" in (
        output
    )
    assert wrong not in result.stdout + result.stderr
    assert _everywhere_else(wrong, tmp_path, job_id) == []
    assert os.path.exists(tmp_path / "user" / "credential.json")
