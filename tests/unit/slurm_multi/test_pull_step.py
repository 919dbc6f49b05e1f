"""slurm_multi.pull_step: the pull step's srun, ended when a node of the run is lost (its playbook heartbeat stood
still, no status.json) while every other node finished - and never while a node may still finish."""

import json
import subprocess
import sys
import time

from slurm_multi.pull_step import LostNodes, claimed_attempt_dir

NONCE = "a" * 32


def _attempt(results, job_id="4242", nonce=NONCE):
    attempt = results / job_id / "attempt-0"
    (attempt / "nodes").mkdir(parents=True)
    (attempt / "run.json").write_text(json.dumps({"nonce": nonce, "origin": "cluster lab, job 4242"}))
    return attempt


def _node(attempt, node, status=False, beat=None):
    node_dir = attempt / "nodes" / node
    node_dir.mkdir(exist_ok=True)
    if status:
        (node_dir / "status.json").write_text('{"status": "FAILURE"}')
    if beat is not None:
        (node_dir / "playbook.alive").write_text(beat)


def test_the_run_is_found_by_its_nonce_among_other_runs_and_jobs(tmp_path):
    _attempt(tmp_path, "4241", nonce="b" * 32)
    _attempt(tmp_path, "4242.run2", nonce="c" * 32)
    assert claimed_attempt_dir(str(tmp_path), 0, NONCE) is None
    mine = _attempt(tmp_path, "4242.3")
    (tmp_path / "4243" / "attempt-0").mkdir(parents=True)
    (tmp_path / "4243" / "attempt-0" / "run.json").write_text("{torn")  # being written: not ours, no error
    assert claimed_attempt_dir(str(tmp_path), 0, NONCE) == str(mine)
    assert claimed_attempt_dir(str(tmp_path), 1, NONCE) is None  # another attempt


def test_a_node_is_lost_only_once_its_beat_stood_still_and_every_other_node_finished(tmp_path):
    attempt = _attempt(tmp_path)
    _node(attempt, "node1", status=True)
    _node(attempt, "node2", beat="1 100.0")
    _node(attempt, "node3", beat="2 100.0")
    watch = LostNodes(str(tmp_path), 0, NONCE, ["node1", "node2", "node3"], stale_after=0.5)
    assert watch.check() == []
    time.sleep(0.3)
    _node(attempt, "node2", beat="1 102.0")  # node2 still beats: it may yet finish
    time.sleep(0.3)
    assert watch.check() == []
    _node(attempt, "node2", status=True)
    lost = watch.check()
    assert [node for node, _ in lost] == ["node3"] and "stopped its heartbeat" in lost[0][1], lost


def test_a_node_that_never_beat_is_lost_after_the_stale_time_and_nothing_is_lost_when_all_finished(tmp_path):
    attempt = _attempt(tmp_path)
    _node(attempt, "node1", status=True)
    watch = LostNodes(str(tmp_path), 0, NONCE, ["node1", "node2"], stale_after=0.3)
    assert watch.check() == []
    time.sleep(0.4)
    assert [node for node, _ in watch.check()] == ["node2"]
    _node(attempt, "node2", status=True)
    assert watch.check() == []


def test_a_node_that_wrote_its_preflight_result_has_the_stale_time_from_then_to_its_first_beat(tmp_path):
    # A loaded machine (CI's, a torch build beside four pipelines): every node's playbook took over the stale time
    # from the run's claim to its first beat, and the step was ended with every node alive and working.
    attempt = _attempt(tmp_path)
    _node(attempt, "node1")
    _node(attempt, "node2")
    watch = LostNodes(str(tmp_path), 0, NONCE, ["node1", "node2"], stale_after=0.4)
    assert watch.check() == []
    time.sleep(0.3)
    (attempt / "preflight").mkdir()
    (attempt / "preflight" / "node1.json").write_text('{"node": "node1", "problems": []}')
    assert watch.check() == []
    time.sleep(0.2)  # past the stale time from the claim, not from node1's preflight result: node1 may finish
    assert watch.check() == []
    _node(attempt, "node2", status=True)
    assert watch.check() == []  # node1 still may beat
    time.sleep(0.3)
    lost = watch.check()  # its preflight result stood still the stale time, and no beat came
    assert [node for node, _ in lost] == ["node1"] and "never wrote its heartbeat" in lost[0][1], lost


def test_the_step_is_killed_when_a_node_is_lost_and_runs_on_otherwise(tmp_path):
    results = tmp_path / "results"
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps({"results_dir": str(results), "heartbeat_stale": 1}))
    # The step's nodes claim the attempt dir with the nonce the pull step gives them; node2 never beats.
    claim = (
        f"a={results}/4242/attempt-0; mkdir -p $a/nodes/node1; touch $a/nodes/node1/status.json; "
        'printf \'{"nonce": "%s"}\' "$SLURM_MULTI_RUN_NONCE" > $a/run.json; exec sleep 60'
    )
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_RESTART_COUNT": "0"}
    started = time.monotonic()
    step = subprocess.run(
        [sys.executable, "-m", "slurm_multi.pull_step", str(vars_file), "--", "sh", "-c", claim],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert step.returncode == 128 + 9, step.stderr
    assert "lost node2 never wrote its heartbeat" in step.stdout and time.monotonic() - started < 10, step.stdout
    # Every node finished: the step's own exit code, whatever it is.
    done = (
        f"a={results}/4343/attempt-0; mkdir -p $a; "
        'printf \'{"nonce": "%s"}\' "$SLURM_MULTI_RUN_NONCE" > $a/run.json; exit 3'
    )
    step = subprocess.run(
        [sys.executable, "-m", "slurm_multi.pull_step", str(vars_file), "--", "sh", "-c", done],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert step.returncode == 3 and "lost" not in step.stdout, step.stdout
