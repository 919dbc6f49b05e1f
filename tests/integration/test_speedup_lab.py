"""The speed-up layer is safe to lose (docs/speedup.md): a push job on the 3-node lab with the layer off, and one on
an ansible-core whose private module the layer imports was renamed (tests/support/changed_ansible.py), both end
SUCCESS on plain Ansible. Neither starts a module server on any node (a server makes its socket dir in
$SLURM_MULTI_MODULE_SERVER_DIR, which every step of the job gets) nor keeps anything in the user's cache; the second
says why, once.

Push mode only (mode_independent): the module server is push mode's; pull mode's node playbooks start none."""

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ansible import ansible_env, run_ansible
from tests.support.changed_ansible import changed_ansible
from tests.support.lab.per_mode_jobs import side_by_side
from tests.support.lab.pipeline import MODE_ENV, PipelineRun

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

STEPS_ASIDE = "slurm-multi's speed-up layer steps aside"


@dataclass
class PushJob:
    run: PipelineRun
    # Where a module server would have made its socket dir; the user's cache.
    servers_dir: Path
    cache_dir: Path


def _push_job(work: Path, env: dict, extra_vars: dict) -> PushJob:
    """run_multi.yml through slurm-multi-playbook, as the job script runs it, on node1-3 in push mode."""
    results = work / "results"
    results.mkdir(parents=True)
    results.chmod(0o755)
    vars_file = work / "vars.json"
    vars_file.write_text(json.dumps({"results_dir": str(results), "model_tags": ["dummy"], **extra_vars}))
    # Short: a server's socket path has at most 107 bytes.
    servers = Path(tempfile.mkdtemp(prefix="msrv-", dir="/tmp"))
    environment = ansible_env(
        **{MODE_ENV: "push"},
        XDG_CACHE_HOME=str(work / "cache"),
        SLURM_MULTI_MODULE_SERVER_DIR=str(servers),
        **env,
    )
    ran = run_ansible(
        ["slurm-multi-playbook", "playbooks/run_multi.yml", "-f", "3", "-e", f"@{vars_file}"],
        nodes=3,
        nodelist="node[1-3]",
        env=environment,
        timeout=900,
    )
    return PushJob(PipelineRun(ran.returncode, ran.stdout + ran.stderr, results), servers, work / "cache")


@pytest.fixture(scope="module")
def jobs(lab_cluster, tmp_path_factory):
    """{"off": the job with speedup false, "changed_ansible": the job on the stand-in ansible-core}, run side by
    side."""
    off = tmp_path_factory.mktemp("speedup-off")
    changed = tmp_path_factory.mktemp("speedup-changed-ansible")
    stand_in = changed_ansible(changed / "ansible-core")
    ran = side_by_side(
        {
            "off": lambda: _push_job(off, {}, {"speedup": False}),
            "changed_ansible": lambda: _push_job(changed, {"PYTHONPATH": str(stand_in)}, {}),
        }
    )
    yield ran
    for job in ran.values():
        shutil.rmtree(job.servers_dir, ignore_errors=True)


def _ran_on_plain_ansible(job: PushJob) -> str:
    """The job's output, once it is known to have succeeded with no part of the layer at work."""
    assert job.run.rc == 0, job.run.output[-3000:]
    assert job.run.record["status"] == "SUCCESS", job.run.record
    assert list(job.servers_dir.iterdir()) == [], "a module server started"
    kept = job.cache_dir / "slurm-multi"
    assert not kept.exists() or list(kept.iterdir()) == [], list(kept.iterdir())
    return job.run.output


def test_a_push_job_with_the_speedup_layer_off_succeeds_without_a_module_server(jobs):
    assert STEPS_ASIDE not in _ran_on_plain_ansible(jobs["off"])


def test_a_push_job_on_an_ansible_core_without_the_layers_private_names_succeeds_saying_so_once(jobs):
    output = _ran_on_plain_ansible(jobs["changed_ansible"])
    assert output.count(STEPS_ASIDE) == 1, output[-3000:]
