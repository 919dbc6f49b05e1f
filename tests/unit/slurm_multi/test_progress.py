"""Progress lines: one per finished task, with its stage and each node's outcome, from output or from events."""

import json
import textwrap

from slurm_multi.progress import PipelineProgress

OUTPUT = textwrap.dedent("""\

    PLAY [Prepare, build and run the model on every node of the allocation] ********

    TASK [preparation : Read the node's facts and make its results directory] ******
    ok: [node1]
    ok: [node3]
    ok: [node2]

    TASK [build : Load rank 0's image from the shared tar cache] *******************
    changed: [node2]
    [ERROR]: Task failed: Module failed: the tar is torn
    fatal: [node3]: FAILED! => 
        changed: false
        msg: 'the tar /cache/sha256-ab.tar is torn: 10 of 20 bytes'

    PLAY [Collect the job's results and write its perf record] *********************

    TASK [postprocessing : Collect every node's results] ***************************
    changed: [localhost -> localhost]
    slurm-multi: early warning (SIGUSR1): the time limit is 180 s away: stopping the pipeline

    PLAY RECAP *********************************************************************
    node1                      : ok=3    changed=0    unreachable=0    failed=0
    """)  # noqa: W291 - Ansible prints "FAILED! => " with its trailing space, and the parser must take it so


def _lines_from_output(text):
    reported = []
    progress = PipelineProgress(reported.append)
    for line in text.splitlines():
        progress.feed_output_line(line)
    progress.task_finished()
    return reported


def test_each_finished_task_gives_one_line_with_its_stage_and_nodes():
    assert _lines_from_output(OUTPUT)[0] == (
        "[preparation] Read the node's facts and make its results directory: ok node[1-3]"
    )


def test_a_failed_node_is_named_last_with_its_message():
    assert _lines_from_output(OUTPUT)[1] == (
        "[build] Load rank 0's image from the shared tar cache: changed node2, FATAL node3"
        "\n    node3: the tar /cache/sha256-ab.tar is torn: 10 of 20 bytes"
    )


def test_the_scripts_own_lines_come_through_as_they_are():
    lines = _lines_from_output(OUTPUT)
    assert lines[2] == "[postprocessing] Collect every node's results: changed localhost"
    assert lines[3] == "slurm-multi: early warning (SIGUSR1): the time limit is 180 s away: stopping the pipeline"
    assert len(lines) == 4


def test_runner_events_give_the_same_lines():
    reported = []
    progress = PipelineProgress(reported.append)
    events = [
        {"event": "playbook_on_play_start", "event_data": {"play": "Prepare"}},
        {"event": "playbook_on_task_start", "event_data": {"task": "Run the model", "role": "running"}},
        {"event": "runner_on_ok", "event_data": {"host": "node1", "res": {"changed": True}}},
        {"event": "runner_on_failed", "event_data": {"host": "node2", "res": {"msg": "docker is gone"}}},
        {"event": "playbook_on_stats", "event_data": {}},
    ]
    for event in events:
        progress.feed_runner_event(event)
    assert reported == ["[running] Run the model: changed node1, FAILED node2\n    node2: docker is gone"]


def test_a_task_no_node_ran_gives_no_line():
    assert _lines_from_output("TASK [build : Skipped everywhere] ****\n\nPLAY RECAP ****\n") == []


def test_an_unreachable_node_is_called_unreachable():
    lines = _lines_from_output(
        "TASK [build : Load the image] ****\n"
        'fatal: [node3]: UNREACHABLE! => {"msg": "node node3 is unreachable through srun"}\n'
    )
    assert lines == ["[build] Load the image: UNREACHABLE node3\n    node3: node node3 is unreachable through srun"]


def test_preflight_table_rows_as_the_nodes_results_land(tmp_path):
    from slurm_multi.progress import preflight_lines

    (tmp_path / "preflight").mkdir()
    shown = set()
    assert preflight_lines(tmp_path, shown) == []
    (tmp_path / "preflight" / "node1.json").write_text(json.dumps({"node": "node1", "problems": []}))
    problem = {"check": "docker", "problem": "Docker daemon not answering on node3", "fix": "start dockerd on node3"}
    (tmp_path / "preflight" / "node3.json").write_text(json.dumps({"node": "node3", "problems": [problem]}))
    lines = preflight_lines(tmp_path, shown)
    assert lines[0] == "[preflight] node1: ok"
    assert lines[1].startswith("[preflight] node3: PROBLEM\n    docker: Docker daemon not answering on node3")
    assert "fix: start dockerd on node3" in lines[1]
    assert preflight_lines(tmp_path, shown) == []
