"""`slurm-multi logs` and the timeline of `report --job` (slurm_multi/reports/job_view.py), on real files."""

import json
import threading
import time

import pytest

from slurm_multi import cli
from slurm_multi.reports import job_view

JOB = "4242"


def _node_dir(results, node, attempt=0):
    path = results / JOB / f"attempt-{attempt}" / "nodes" / node
    path.mkdir(parents=True, exist_ok=True)
    return path


def _status(results, node, rank, **fields):
    (_node_dir(results, node) / "status.json").write_text(json.dumps(dict(node=node, rank=rank, **fields)))


def test_every_line_is_prefixed_with_its_node_and_rank_in_rank_order(tmp_path):
    results = tmp_path / "results"
    for node in ("node1", "node2", "node3", "node9"):
        (_node_dir(results, node) / "run.log").write_text(f"hello from {node}\nbye\n")
    # node3's status names its rank; node1 and node2 have none yet: SLURM's node order gives theirs; node9 is in
    # neither (its rank is unknown, it comes last).
    _status(results, "node3", 2)
    lines = []
    job_view.follow_logs(results, JOB, emit=lines.append, job_info=lambda _: {"NodeList": "node[2,1]"})
    assert lines == [
        "node2 r0 | hello from node2",
        "node2 r0 | bye",
        "node1 r1 | hello from node1",
        "node1 r1 | bye",
        "node3 r2 | hello from node3",
        "node3 r2 | bye",
        "node9 r? | hello from node9",
        "node9 r? | bye",
    ]


def test_a_node_or_rank_filter_keeps_that_nodes_lines(tmp_path):
    results = tmp_path / "results"
    for rank, node in enumerate(["node1", "node2"]):
        (_node_dir(results, node) / "run.log").write_text(f"line of {node}\n")
        _status(results, node, rank)
    by_rank, by_node = [], []
    job_view.follow_logs(results, JOB, rank=1, emit=by_rank.append)
    job_view.follow_logs(results, JOB, node="node1", emit=by_node.append)
    assert by_rank == ["node2 r1 | line of node2"] and by_node == ["node1 r0 | line of node1"]
    missing = []
    job_view.follow_logs(results, JOB, rank=7, emit=missing.append)
    assert missing == [f"job {JOB}: rank 7 has no run.log under {results / JOB / 'attempt-0'} (other nodes have one)"]


def test_colours_only_when_asked_and_a_pipe_gets_none(tmp_path):
    results = tmp_path / "results"
    (_node_dir(results, "node1") / "run.log").write_text("x\n")
    _status(results, "node1", 0)
    coloured, plain = [], []
    job_view.follow_logs(results, JOB, emit=coloured.append, colour=True)
    job_view.follow_logs(results, JOB, emit=plain.append)
    assert coloured == ["\033[36mnode1 r0 | \033[0mx"] and plain == ["node1 r0 | x"]
    with open(tmp_path / "pipe.txt", "w") as not_a_tty:
        assert not job_view.use_colour(not_a_tty)


def test_follow_shows_lines_as_they_are_written_until_the_job_ends(tmp_path):
    results = tmp_path / "results"
    logs = {node: _node_dir(results, node) / "run.log" for node in ("node1", "node2")}
    state = {"JobState": "RUNNING", "NodeList": "node[1-2]", "Restarts": "0"}
    seen = []

    def write_then_end():
        for step in range(3):
            for node, log in logs.items():
                with open(log, "a") as handle:
                    handle.write(f"{node} step {step}\n")
            time.sleep(0.15)
        with open(logs["node2"], "a") as handle:
            handle.write("no newline at the end")
        time.sleep(0.3)
        state["JobState"] = "COMPLETED"

    writer = threading.Thread(target=write_then_end)
    writer.start()
    job_view.follow_logs(results, JOB, follow=True, emit=seen.append, poll_interval=0.05, job_info=lambda _: state)
    writer.join()
    assert [line for line in seen if line.startswith("node1")] == [f"node1 r0 | node1 step {i}" for i in range(3)]
    assert [line for line in seen if line.startswith("node2")] == [f"node2 r1 | node2 step {i}" for i in range(3)] + [
        "node2 r1 | no newline at the end"
    ]
    # Interleaved as written: node2's step 0 comes before node1's step 2.
    assert seen.index("node2 r1 | node2 step 0") < seen.index("node1 r0 | node1 step 2")


def test_a_job_that_never_started_says_so(tmp_path):
    results = tmp_path / "results"
    lines = []
    job_view.follow_logs(
        results, JOB, emit=lines.append, job_info=lambda _: {"JobState": "PENDING", "Reason": "Resources"}
    )
    assert lines == [f"job {JOB} has not started yet (PENDING): no node has written a log; --follow waits for it"]
    (results / JOB / "attempt-0").mkdir(parents=True)
    ended = []
    job_view.follow_logs(results, JOB, follow=True, emit=ended.append, job_info=lambda _: {"JobState": "CANCELLED"})
    assert ended[0].startswith(f"job {JOB} started no model run on any node yet (SLURM state CANCELLED)")


def test_an_unknown_job_or_a_bad_id_is_refused_with_what_to_do(tmp_path, capsys):
    with pytest.raises(job_view.JobLogsError, match="no job 77 in .* SLURM knows no such job"):
        job_view.follow_logs(tmp_path, "77", job_info=lambda _: None)
    assert cli.main(["logs", "../etc", "--results-dir", str(tmp_path)]) == cli.EXIT_USAGE
    assert "is not a SLURM job ID" in capsys.readouterr().err


def test_report_job_prints_the_timeline_of_the_record(tmp_path):
    results = tmp_path / "results"
    (results / "records").mkdir(parents=True)
    start = 1_700_000_000.0
    record = {
        "attempt": 0,
        "timeline": {
            "node1": {"load": {"start": start, "end": start + 2}},
            "node2": {"load": {"start": start, "end": start + 2.5}},
            "node3": {"load": {"start": start, "end": start + 41}},
        },
        "perf_summary": {
            "tok/s": {
                "n_nodes": 3,
                "mean": 90.0,
                "std": 17.3,
                "cv": 0.19,
                "per_node": {"node3": 60.0},
                "outliers": ["node3"],
            }
        },
    }
    (results / "records" / f"{JOB}.json").write_text(json.dumps(record))
    lines = job_view.timeline_lines(results, JOB)
    assert lines[0].startswith(f"Stage timeline (record of job {JOB}, attempt 0")
    assert "load: node3 took 41.0 s, 18.2x the median of the others (2.2 s)" in lines
    assert "tok/s across 3 nodes: mean 90, std 17.3, cv 19.0%; outlier: node3 60" in lines


def test_submit_follow_needs_wait(capsys):
    assert cli.main(["submit", "-N", "3", "--tags", "dummy", "--follow"]) == cli.EXIT_USAGE
    assert "--follow shows the logs while --wait follows the job: give both" in capsys.readouterr().err


def test_after_the_run_the_lines_interleave_as_the_times_files_say_they_were_written(tmp_path):
    results = tmp_path / "results"
    node1, node2 = _node_dir(results, "node1"), _node_dir(results, "node2")
    (node1 / "run.log").write_text("a1\na2\na3\n")
    (node1 / "run.log.times").write_text("0 100.0\n6 102.0\n")  # a1 and a2 at 100 s, a3 at 102 s
    (node2 / "run.log").write_text("b1\nb2\n")
    (node2 / "run.log.times").write_text("0 101.0\n3 103.0\n")
    (_node_dir(results, "node3") / "run.log").write_text("c1\n")  # no times file: after the others
    lines = []
    job_view.follow_logs(results, JOB, emit=lines.append, job_info=lambda _: {"NodeList": "node[1-3]"})
    assert lines == [
        "node1 r0 | a1",
        "node1 r0 | a2",
        "node2 r1 | b1",
        "node1 r0 | a3",
        "node2 r1 | b2",
        "node3 r2 | c1",
    ]


def test_a_run_log_planted_as_a_symlink_is_not_followed(tmp_path):
    results = tmp_path / "results"
    secret = tmp_path / "secret.txt"
    secret.write_text("private key\n")
    (_node_dir(results, "node1") / "run.log").symlink_to(secret)
    (_node_dir(results, "node2") / "run.log").write_text("honest line\n")
    lines = []
    job_view.follow_logs(results, JOB, emit=lines.append, job_info=lambda _: {"NodeList": "node[1-2]"})
    assert lines == ["node2 r1 | honest line"]


def test_report_of_a_sweep_prints_each_models_timeline(tmp_path):
    results = tmp_path / "results"
    (results / "records").mkdir(parents=True)
    steps = {"node1": {"run": {"start": 10.0, "end": 12.0}}, "node2": {"run": {"start": 10.0, "end": 12.5}}}
    for index in (1, 2):
        (results / "records" / f"{JOB}.{index}.json").write_text(json.dumps({"attempt": 0, "timeline": steps}))
    sweep = [{"index": index, "model": f"m{index}", "job_id": f"{JOB}.{index}"} for index in (1, 2)]
    (results / "records" / f"{JOB}.json").write_text(json.dumps({"attempt": 0, "sweep": sweep}))
    lines = job_view.timeline_lines(results, JOB)
    assert lines[0] == f"model 1 m1 (job {JOB}.1):"
    assert lines[1].startswith(f"  Stage timeline (record of job {JOB}.1, attempt 0")
    assert f"model 2 m2 (job {JOB}.2):" in lines
    assert job_view.timeline_lines(results, "../x")[0].startswith("Stage timeline: none: job_id '../x'")


def test_following_a_pending_job_says_once_that_it_waits_for_it_to_start(tmp_path):
    results = tmp_path / "results"
    (results / JOB / "attempt-0").mkdir(parents=True)
    answers = iter(
        [{"JobState": "PENDING", "Reason": "Priority"}] * 3
        + [{"JobState": "RUNNING", "NodeList": "node1"}, {"JobState": "COMPLETED", "NodeList": "node1"}]
    )
    last = {}

    def job_info(_):
        last.update(next(answers, last))
        return dict(last)

    lines = []
    job_view.follow_logs(results, JOB, follow=True, emit=lines.append, poll_interval=0.01, job_info=job_info)
    assert lines.count(f"job {JOB} is PENDING (Priority): waiting for it to start") == 1, lines


def test_report_job_says_who_a_hung_run_waited_for_and_where_each_nodes_stacks_are(tmp_path, capsys):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
    from tests.support.lab.hang_results import NODES, write_hung_job

    results = tmp_path / "results"
    attempt_dir = write_hung_job(results, job_id=JOB)
    collect_job(str(results), JOB, {"name": "ddp_hang"}, NODES)
    assert cli.main(["report", "--results-dir", str(results), "--job", JOB]) == 0
    out = capsys.readouterr().out.splitlines()
    summary = "rank 2 (node3) is stuck in load_batch (ddp_hang.py:22) while ranks 0 and 1 wait in all_reduce"
    assert f"Hang (collective): {summary}" in out
    assert f"  node3's stacks: {attempt_dir / 'nodes' / 'node3' / 'stacks.txt'}" in out


def test_a_run_that_did_not_hang_has_no_hang_lines(tmp_path):
    results = tmp_path / "results"
    (results / "records").mkdir(parents=True)
    (results / "records" / f"{JOB}.json").write_text(json.dumps({"attempt": 0, "hang": None}))
    assert job_view.hang_lines(results, JOB) == []
