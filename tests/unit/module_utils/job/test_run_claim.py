"""Which run an attempt dir belongs to (module_utils/job/run_claim.py): a second run in one allocation is a new run,
and a run from elsewhere under the same job ID stops, naming the dir."""

import json
import os
import threading

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.run_claim import claim_run, run_origin
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm import allocation
from plugins.filter.job_layout import claim_run_id

HERE = run_origin("lab", "4242", "2026-12-01T10:00:00", "node1")
ELSEWHERE = run_origin("other", "4242", "2026-11-02T08:00:00", "login2")


def test_the_first_run_takes_the_jobs_id_and_says_so_in_its_attempt_dir(tmp_path):
    assert claim_run(str(tmp_path), "4242", 0, "n1", HERE) == "4242"
    assert json.loads((tmp_path / "4242" / "attempt-0" / "run.json").read_text()) == {"nonce": "n1", "origin": HERE}


def test_a_second_and_third_run_of_the_allocation_are_new_runs_beside_the_first(tmp_path):
    ids = [claim_run(str(tmp_path), "4242", 0, nonce, HERE) for nonce in ("n1", "n2", "n3")]
    assert ids == ["4242", "4242.run2", "4242.run3"]
    assert claim_run(str(tmp_path), "4242", 0, "n2", HERE) == "4242.run2"  # the same run asking again


def test_a_requeued_attempt_of_the_same_job_is_that_job_not_another_run(tmp_path):
    assert claim_run(str(tmp_path), "4242", 0, "n1", HERE) == "4242"
    assert claim_run(str(tmp_path), "4242", 1, "n2", HERE) == "4242"


def test_every_node_of_a_pull_mode_run_claims_the_same_dir(tmp_path):
    claim_run(str(tmp_path), "4242", 0, "earlier", HERE)
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(claim_run(str(tmp_path), "4242", 0, "n", HERE))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == ["4242.run2"] * 8
    assert sorted(path.name for path in (tmp_path / "4242.run2" / "attempt-0").iterdir()) == ["run.json"]


def test_a_run_from_elsewhere_under_the_same_job_id_stops_naming_the_dir_and_the_fix(tmp_path):
    claim_run(str(tmp_path), "4242", 0, "theirs", ELSEWHERE)
    with pytest.raises(JobLayoutError) as raised:
        claim_run(str(tmp_path), "4242", 0, "ours", HERE)
    message = str(raised.value)
    assert f"{tmp_path / '4242' / 'attempt-0'} holds a run from elsewhere (cluster other, job 4242" in message
    assert "Give this job its own results_dir, or move" in message
    assert not (tmp_path / "4242.run2").exists()


def test_an_explicit_job_id_held_by_another_run_is_refused_not_renumbered(tmp_path):
    claim_run(str(tmp_path), "4242.1", 0, "n1", HERE, numbered=False)
    with pytest.raises(JobLayoutError, match=r"holds another run of job 4242.1 attempt 0 .*give this run a job ID"):
        claim_run(str(tmp_path), "4242.1", 0, "n2", HERE, numbered=False)


@pytest.mark.parametrize("content", ["", "{not json", "[1]"])
def test_an_unreadable_or_foreign_claim_is_an_error_or_no_ones(tmp_path, content):
    attempt = tmp_path / "4242" / "attempt-0"
    attempt.mkdir(parents=True)
    (attempt / "run.json").write_text(content)
    with pytest.raises(JobLayoutError, match="cannot be read|holds a run from elsewhere"):
        claim_run(str(tmp_path), "4242", 0, "n1", HERE)


def test_a_run_without_a_nonce_is_refused():
    with pytest.raises(JobLayoutError, match="the run has no nonce"):
        claim_run("/nonexistent", "4242", 0, "", HERE)


# --- SLURM's answer about the job's start: a transient error never decides who owns a run dir ---------------------

STARTED = "2026-12-01T10:00:00"
FAKE_SQUEUE = f"""#!/bin/sh
# A squeue that acts by its plan: line N for its Nth call (the last line for any later one).
dir=$(dirname "$0")
echo "$@" >> "$dir/calls"
step=$(sed -n "$(wc -l < "$dir/calls")p" "$dir/plan")
[ -n "$step" ] || step=$(tail -n 1 "$dir/plan")
case "$step" in
  ok) echo "{STARTED}" ;;
  fail) echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1 ;;
  hang) exec sleep 30 ;;
esac
"""


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A real `squeue` first on PATH, in this allocation (job 4242 on cluster lab); `squeue(*plan)` sets what its
    next calls do (ok: print the start, fail: SLURM's socket timeout, hang: sleep past the timeout) and returns
    the list of argvs it was called with so far."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(FAKE_SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "lab")
    for name in ("SLURM_JOBID", "SLURM_MULTI_JOB_START"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocation, "SQUEUE_TIMEOUT", 0.5)
    monkeypatch.setattr(allocation, "SQUEUE_RETRY_PAUSE", 0.05, raising=False)

    def plan(*steps):
        (bin_dir / "calls").write_text("")
        (bin_dir / "plan").write_text("\n".join(steps) + "\n")

    plan("ok")
    return plan


def squeue_calls(tmp_path):
    return (tmp_path / "bin" / "calls").read_text().splitlines()


@pytest.mark.parametrize("failure", ["fail", "hang"])
def test_a_rerun_whose_squeue_fails_or_hangs_is_a_new_run_of_the_allocation_with_a_warning(
    tmp_path, squeue, capfd, failure
):
    """The first run knew when the job started; squeue fails (or outlives its timeout) on every try of the second:
    the second run is 4242.run2, saying what was unknown and why, never "holds a run from elsewhere"."""
    results = tmp_path / "results"
    assert claim_run_id("4242", str(results), 0, "n1") == "4242"
    squeue(failure)
    assert claim_run_id("4242", str(results), 0, "n2") == "4242.run2"
    warned = capfd.readouterr().err
    assert "SLURM did not say when job 4242 started" in warned
    assert ("Socket timed out" if failure == "fail" else "did not answer within 0.5 s") in warned
    assert len(squeue_calls(tmp_path)) == allocation.SQUEUE_ATTEMPTS > 1  # asked again, a bounded few times


def test_a_squeue_failing_once_is_asked_again_and_the_rerun_needs_no_warning(tmp_path, squeue, capfd):
    results = tmp_path / "results"
    assert claim_run_id("4242", str(results), 0, "n1") == "4242"
    squeue("fail", "ok")
    assert claim_run_id("4242", str(results), 0, "n2") == "4242.run2"
    assert squeue_calls(tmp_path) == ["-h -j 4242 -o %S"] * 2
    assert "SLURM did not say" not in capfd.readouterr().err


def test_a_second_run_of_the_allocation_says_which_job_it_is_and_the_first_says_nothing(tmp_path, squeue, capfd):
    # The filter says it (the preflight role had a debug task for it, which forked a worker on every run to skip).
    # Attempt 7: Ansible's Display prints a warning once per process, and the other tests here claim attempt 0.
    results = tmp_path / "results"
    assert claim_run_id("4242", str(results), 7, "n1") == "4242"
    assert "Another run" not in capfd.readouterr().err
    assert claim_run_id("4242", str(results), 7, "n2") == "4242.run2"
    warned = " ".join(capfd.readouterr().err.split())
    assert "Another run of this allocation already holds job 4242 attempt 7: this run is job 4242.run2" in warned


def test_a_run_claimed_while_the_start_was_unknown_is_this_allocations_for_the_next_run(tmp_path, squeue, capfd):
    results = tmp_path / "results"
    squeue("fail")
    assert claim_run_id("4242", str(results), 0, "n1") == "4242"
    squeue("ok")
    assert claim_run_id("4242", str(results), 0, "n2") == "4242.run2"
    warned = capfd.readouterr().err
    assert "holds a run of job 4242 whose start SLURM did not say when claimed" in warned
    assert "so this run is 4242.run2" in warned


def test_an_unknown_start_never_makes_another_clusters_run_this_allocations(tmp_path, squeue):
    results = tmp_path / "results"
    claim_run(str(results), "4242", 0, "theirs", run_origin("other", "4242", None, "login2"))
    squeue("fail")
    with pytest.raises(AnsibleFilterError, match=r"holds a run from elsewhere \(cluster other, job 4242 started \?"):
        claim_run_id("4242", str(results), 0, "ours")
