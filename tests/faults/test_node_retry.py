"""`submit --retries N` on the lab: a job that failed because of a node is resubmitted without it by its afterany
collect job, and `--wait` follows the new job; a model failure is never retried.

node3's Docker daemon is stopped once (lab_daemon_stopped, restarted in a finally) for the jobs that need it down:
the retried job followed by `--wait` in both modes and the one retried after the submitting shell is gone (who
resubmits it, the collect job, is no matter of the mode: push mode only), all three submitted side by side
(`--no-exclusive`; their only bound, 600 s, is far above what they take). With 4 lab nodes up the `--wait` job
asks for 3 (node1-3 first, node1,2,4 on the retry); with 3 it asks for 2 with `--nodelist node3` (node1,3 first,
node1,2 on the retry: node3 also leaves the node list).
"""

import json
import secrets
import time
from pathlib import Path

import pytest

from slurm_multi.submission import sbatch
from tests.faults import lab_daemon_stopped
from tests.integration.run.test_pipeline_security_lab import files_holding
from tests.integration.submit.test_submit_lab import _cli
from tests.support.lab.per_mode_jobs import MODES, side_by_side
from tests.support.lab.pipeline import MODE_ENV

pytestmark = [pytest.mark.lab, pytest.mark.fault]


def _records(results: Path) -> dict:
    return {path.stem: json.loads(path.read_text()) for path in (results / "records").glob("*.json")}


def _decided(results: Path, job_id: str, timeout: float = 600) -> dict:
    """Job ``job_id``'s record once its collect job has added the retry decision (``retries``)."""
    path = results / "records" / f"{job_id}.json"
    deadline = time.monotonic() + timeout
    while True:
        record = json.loads(path.read_text()) if path.is_file() else {}
        if any(entry["job_id"] == job_id for entry in record.get("retries", [])):
            return record
        assert time.monotonic() < deadline, f"job {job_id}: no retry decision in {timeout} s"
        time.sleep(2)


def _submit_args(results: Path, *args) -> list:
    return ["submit", "--no-exclusive", "--wait", "--results-dir", str(results), *args]


def _retried_with_wait(base, mode):
    """`submit --wait --retries 1` of a job that fails on node3: (base, the CLI's result, its seconds, the token)."""
    results = base / "results"
    usable = sbatch.usable_nodes()
    shape = ["-N", "3"] if len(usable) >= 4 else ["-N", "2", "--nodelist", "node3"]
    token = "retry-" + secrets.token_hex(12)
    started = time.monotonic()
    run = _cli(
        _submit_args(results, *shape, "--tags", "dummy", "--retries", "1"),
        base,
        extra_env={"MAD_SECRETS_HFTOKEN": token, MODE_ENV: mode},
        timeout=900,
    )
    return base, run, time.monotonic() - started, token


def _retried_without_the_shell(base, mode):
    """`submit --retries 1` without --wait, node3 named in --nodelist (whatever the lab's size): the retry takes it
    out of the list as well as excluding it. (base, first job ID, its record once decided, the retry's record)."""
    results = base / "results"
    shape = ["-N", "2", "--nodelist", "node3"]
    run = _cli(
        ["submit", "--no-exclusive", "--results-dir", str(results), *shape, "--tags", "dummy", "--retries", "1"],
        base,
        extra_env={MODE_ENV: mode},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    first_id = run.stdout.split("Submitted job ")[1].split()[0]
    first = _decided(results, first_id)
    retried_as = first["retries"][0]["retried_as"]
    return base, first_id, first, _decided(results, retried_as["job_id"]) if retried_as else None


@pytest.fixture(scope="module")
def node3_down_jobs(lab_cluster, tmp_path_factory):
    """(kind, mode) -> what the kind's submission returned, every one run while node3's dockerd is down."""
    kinds = {"wait": _retried_with_wait, "no_shell": _retried_without_the_shell}
    # Who resubmits without the shell (the afterany collect job) is no matter of the mode; the retried job's own
    # script, which is, runs in both modes in the --wait jobs.
    every = [("wait", mode) for mode in MODES] + [("no_shell", "push")]
    with lab_daemon_stopped("node3", "dockerd"):
        return side_by_side(
            {
                key: (lambda key=key: kinds[key[0]](tmp_path_factory.mktemp(f"retry-{key[0]}-{key[1]}"), key[1]))
                for key in every
            }
        )


def test_a_job_failing_on_a_node_is_retried_without_it_and_succeeds(node3_down_jobs, pipeline_mode):
    tmp_path, run, seconds, token = node3_down_jobs["wait", pipeline_mode]
    results = tmp_path / "results"
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    first_id = output.split("Submitted job ")[1].split()[0]
    records = _records(results)
    (second_id,) = [job for job in records if job != first_id]
    first, second = records[first_id], records[second_id]

    # The first attempt failed because of node3's Docker, and says so; the retry ran without node3 and succeeded.
    assert first["status"] == "FAILURE" and "node3" in first["reason"], first["reason"]
    assert "node3" in first["nodes"]
    assert second["status"] == "SUCCESS", second["reason"]
    assert "node3" not in second["nodes"] and len(second["nodes"]) == len(first["nodes"])
    # Both attempts in the final record: job, nodes, verdict, why it ended, what the retry rule made of it.
    attempts = second["retries"]
    assert [entry["job_id"] for entry in attempts] == [first_id, second_id]
    assert attempts[0]["cause"] == "nodes" and list(attempts[0]["blamed_nodes"]) == ["node3"], attempts[0]
    assert "Docker" in attempts[0]["blamed_nodes"]["node3"]
    assert attempts[0]["retried_as"]["job_id"] == second_id and attempts[0]["status"] == "FAILURE"
    assert attempts[1]["status"] == "SUCCESS" and attempts[1]["retried_as"] is None
    assert attempts[1]["excluded"] == ["node3"] and attempts[1]["nodes"] == second["nodes"]
    assert first["retries"] == attempts[:1]  # the first job's own record says it was retried, and as which job
    # --wait said why it resubmitted, and printed both attempts.
    assert f"retried as job {second_id} without node3" in output, output[-3000:]
    assert f"attempt: job {first_id} on " in output and f"attempt: job {second_id} on " in output
    assert seconds < 600, seconds
    # The retry reused the job's secrets file (never argv), which stays 0600 while SLURM may requeue either job;
    # the secret is in no record, log, script or output.
    home = tmp_path / "home"
    assert token not in output
    (private_dir,) = (home / ".slurm-multi" / "jobs").iterdir()
    assert files_holding(token, results, home) == [str(private_dir / "secrets.env")]
    assert (private_dir / "job-retry-1.sbatch").is_file()
    assert "#SBATCH --exclude=node3" in (private_dir / "job-retry-1.sbatch").read_text()


@pytest.mark.mode_independent  # the retry rule reads the record, whose model failure both modes write alike
def test_a_model_failure_is_not_retried(lab_cluster, tmp_path):
    results = tmp_path / "results"
    run = _cli(_submit_args(results, "-N", "3", "--tags", "dummy_fail", "--retries", "1"), tmp_path, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output[-4000:]
    records = _records(results)
    # The last job (the first one, unless another engineer's fault on the shared lab failed it first because of a
    # node) failed because of the model, and nothing was submitted after it.
    final = records[max(records, key=int)]
    entry = final["retries"][-1]
    assert entry["cause"] == "model" and entry["retried_as"] is None, (entry, output[-4000:])
    assert "the model itself failed on " in entry["why"] and "(rank 1)" in entry["why"], entry["why"]
    assert len(records) == len(final["retries"])
    assert "not a node's fault" in output


@pytest.mark.mode_independent
def test_the_retry_happens_after_the_submitting_shell_is_gone(node3_down_jobs):
    # No --wait: `submit` returns at once, and the afterany collect job alone decides and resubmits.
    _, first_id, first, final = node3_down_jobs["no_shell", "push"]
    assert first["retries"][0]["retried_as"], (
        f"job {first_id} was not retried: {first['retries'][0]['why']} (a test restoring the shared lab may "
        "have restarted node3's dockerd meanwhile)"
    )
    assert "node3" in first["nodes"] and len(first["nodes"]) == 2
    assert final["status"] == "SUCCESS" and "node3" not in final["nodes"] and len(final["nodes"]) == 2, final
    assert final["retries"][0]["job_id"] == first_id and final["retries"][0]["retried_as"]["job_id"] == final["job_id"]
