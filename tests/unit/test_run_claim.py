"""Which run an attempt dir belongs to (module_utils/job/run_claim.py): a second run in one allocation is a new run,
and a run from elsewhere under the same job ID stops, naming the dir."""

import json
import threading

import pytest

from ansible.module_utils.job.layout import JobLayoutError
from ansible.module_utils.job.run_claim import claim_run, run_origin

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
