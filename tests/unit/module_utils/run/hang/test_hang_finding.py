"""The analysis of a hung run's stacks (module_utils/run/hang/finding.py): which rank is stuck, which ones wait for it.

The three cases of tests/fixtures/hang_stacks are real py-spy dumps of torch ranks (see its README); the others are
built here in stacks.json's form (docs/contracts.md) from the same frames.
"""

import copy
import json
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import hang_finding

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "hang_stacks"
LIB = "/usr/local/lib/python3.11/dist-packages/torch/distributed/distributed_c10d.py"
TRAIN = "/myworkspace/train.py"


def _recorded(case):
    return {path.stem: json.loads(path.read_text()) for path in sorted((FIXTURES / case).glob("*.json"))}


def _frame(function, file=TRAIN, line=1):
    return {"function": function, "file": file, "line": line, "source": None}


def _in(*functions):
    """A main thread's frames, innermost first: ``_in("all_reduce", "main")``; torch's calls in torch's file."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang import finding as hang

    known = hang.COLLECTIVE_FUNCTIONS | hang.RENDEZVOUS_FUNCTIONS
    return [_frame(name, LIB if name in known else TRAIN, 10 + index) for index, name in enumerate(functions)]


def _process(pid, frames, rank=None, ppid=1, command="python3 train.py", python=True, error=None):
    threads = (
        [] if frames is None else [{"id": "1", "name": "MainThread", "main": True, "idle": None, "frames": frames}]
    )
    return {
        "pid": pid,
        "ppid": ppid,
        "command": command,
        "rank": rank,
        "local_rank": 0 if rank is not None else None,
        "python": python,
        "error": error,
        "threads": threads,
    }


def _node(rank, *processes):
    return {"node": f"node{rank + 1}", "rank": rank, "container": f"slurm-multi-7-r{rank}", "why": "hang",
            "taken_at": 1.0, "processes": list(processes), "docker_top": "", "log_tail": []}  # fmt: skip


def _job(*frames_per_rank):
    """One node per rank, its one Python process running the given main thread."""
    return {
        f"node{rank + 1}": _node(rank, _process(100 + rank, frames, rank=rank))
        for rank, frames in enumerate(frames_per_rank)
    }


WAITING = _in("all_reduce", "main", "<module>")
LOADING = _in("load_batch", "main", "<module>")


def test_the_rank_outside_all_reduce_is_the_stuck_one_in_a_recorded_torch_hang():
    finding = hang_finding(_recorded("allreduce"))
    assert finding["kind"] == "collective"
    assert (finding["stuck_ranks"], finding["waiting_ranks"], finding["never_joined"]) == ([2], [0, 1], [])
    assert (
        finding["summary"]
        == "rank 2 (node3) is stuck in load_batch (ddp_hang.py:22) while ranks 0 and 1 wait in all_reduce"
    )


def test_every_nodes_stacks_file_is_named_beside_the_finding():
    finding = hang_finding(_recorded("allreduce"))
    assert finding["stacks"] == {f"node{n}": f"nodes/node{n}/stacks.txt" for n in (1, 2, 3)}


def test_a_rank_that_never_called_init_process_group_never_joined_in_a_recorded_torch_hang():
    finding = hang_finding(_recorded("init"))
    assert (finding["kind"], finding["stuck_ranks"], finding["never_joined"]) == ("rendezvous", [2], [2])
    assert finding["summary"] == (
        "ranks 0 and 1 wait in init_process_group; rank 2 (node3) never joined: it is in load_weights (ddp_hang.py:26)"
    )


def test_torchrun_agents_waiting_for_a_node_without_python_name_that_node_as_never_joined():
    # torchrun's agents (RANK from the launcher's environment, yet launchers) stand for their nodes' ranks.
    finding = hang_finding(_recorded("agents_in_rendezvous"))
    assert (finding["kind"], finding["stuck_ranks"], finding["waiting_ranks"]) == ("rendezvous", [2], [0, 1])
    assert finding["summary"] == (
        "ranks 0 and 1 wait in SimpleElasticAgent._rendezvous; rank 2 (node3) never joined: it runs no Python "
        "process (see nodes/node3/stacks.txt)"
    )


def test_the_odd_one_out_among_many_ranks_in_the_same_place_is_named():
    # Every rank is in a collective, the odd one in another one: none stands outside torch's waits.
    ranks = [WAITING] * 7 + [_in("broadcast", "main", "<module>")]
    finding = hang_finding(_job(*ranks))
    assert (finding["kind"], finding["stuck_ranks"], finding["waiting_ranks"]) == ("collective", [7], list(range(7)))
    assert (
        finding["summary"]
        == "rank 7 (node8) is stuck in broadcast at main (train.py:11) while ranks 0-6 wait in all_reduce"
    )


def test_the_odd_one_out_is_found_by_functions_and_files_not_line_numbers():
    same_place_other_line = copy.deepcopy(LOADING)
    same_place_other_line[0]["line"] = 99
    finding = hang_finding(_job(LOADING, same_place_other_line, _in("decode", "main", "<module>")))
    assert (finding["stuck_ranks"], finding["waiting_ranks"], finding["kind"]) == ([2], [0, 1], "unknown")
    assert (
        finding["summary"]
        == "rank 2 (node3) is stuck in decode (train.py:10) while ranks 0 and 1 are in load_batch (train.py:10)"
    )


def test_in_a_two_against_two_tie_the_ranks_outside_the_collective_are_stuck():
    finding = hang_finding(_job(WAITING, LOADING, WAITING, LOADING))
    assert (finding["stuck_ranks"], finding["waiting_ranks"], finding["kind"]) == ([1, 3], [0, 2], "collective")
    assert finding["summary"].startswith("rank 1 (node2) is stuck in load_batch (train.py:10) and rank 3 (node4)")


def test_two_ranks_that_differ_outside_any_collective_name_no_one():
    finding = hang_finding(_job(LOADING, _in("decode", "main")))
    assert (finding["kind"], finding["stuck_ranks"], finding["waiting_ranks"]) == ("unknown", [], [])
    assert finding["summary"] == (
        "the ranks' stacks differ with no odd one out: rank 0 is in load_batch (train.py:10) and rank 1 in decode "
        "(train.py:10)"
    )


def test_ranks_all_in_the_same_collective_name_no_one():
    finding = hang_finding(_job(WAITING, WAITING, WAITING))
    assert (finding["kind"], finding["stuck_ranks"]) == ("unknown", [])
    assert finding["summary"] == "every rank is in the same place, all_reduce: no odd one out"


def test_a_single_rank_is_the_stuck_one():
    finding = hang_finding(_job(LOADING))
    assert (finding["stuck_ranks"], finding["waiting_ranks"]) == ([0], [])
    assert finding["summary"] == "rank 0 (node1) is stuck in load_batch (train.py:10)"


def test_without_python_anywhere_the_summary_points_to_docker_top_and_the_log():
    shell = _process(100, None, rank=0, command="sh run.sh", python=False, error="not a Python process")
    finding = hang_finding({"node1": _node(0, shell)})
    assert (finding["kind"], finding["stuck_ranks"]) == ("unknown", [])
    assert finding["summary"] == "no Python stacks: see docker top and the log in nodes/node1/stacks.txt"


def test_a_node_that_wrote_no_stacks_is_the_one_the_waiting_ranks_wait_for():
    stacks = _job(WAITING, WAITING)
    stacks["node3"] = None
    finding = hang_finding(stacks, node_ranks={"node1": 0, "node2": 1, "node3": 2})
    assert (finding["kind"], finding["stuck_ranks"], finding["waiting_ranks"]) == ("collective", [2], [0, 1])
    assert (
        finding["summary"]
        == "rank 2 (node3) left no stacks (node3 wrote no stacks.json) while ranks 0 and 1 wait in all_reduce"
    )
    assert "node3" not in finding["stacks"]


def test_a_rank_py_spy_could_not_read_says_why():
    stacks = _job(WAITING, WAITING)
    stacks["node3"] = _node(2, _process(300, None, rank=2, error="py-spy: Permission denied (os error 13)"))
    finding = hang_finding(stacks)
    assert finding["stuck_ranks"] == [2]
    assert finding["summary"].startswith("rank 2 (node3) has no stacks: py-spy: Permission denied (os error 13) while")


def test_a_data_loader_worker_inherits_its_ranks_rank_but_is_no_rank_of_its_own():
    stacks = _job(WAITING, WAITING, LOADING)
    worker = _process(203, _in("_worker_loop", "main"), rank=2, ppid=102)
    stacks["node3"]["processes"].append(worker)
    finding = hang_finding(stacks)
    assert (finding["stuck_ranks"], finding["waiting_ranks"]) == ([2], [0, 1])


def test_several_ranks_on_a_node_are_each_a_rank():
    node1 = _node(0, _process(101, WAITING, rank=0), _process(102, LOADING, rank=1), _process(103, WAITING, rank=2))
    finding = hang_finding({"node1": node1})
    assert (
        finding["summary"]
        == "rank 1 (node1) is stuck in load_batch (train.py:10) while ranks 0 and 2 wait in all_reduce"
    )


@pytest.mark.parametrize(
    "threads", [[], [{"id": "1", "name": "worker", "main": False, "idle": True, "frames": LOADING}]]
)
def test_a_process_without_a_main_thread_uses_its_first_thread_or_has_no_stacks(threads):
    stacks = _job(WAITING, WAITING, LOADING)
    stacks["node3"]["processes"][0]["threads"] = threads
    assert hang_finding(stacks)["stuck_ranks"] == [2]


def test_a_rank_without_frames_beside_a_stuck_one_is_named_neither_stuck_nor_waiting():
    # Rank 1 was dumped once rank 2's stop broke its all_reduce: printing that traceback, past its last frame.
    finding = hang_finding(_job(WAITING, [], LOADING))

    assert (finding["stuck_ranks"], finding["waiting_ranks"]) == ([2], [0])
    assert finding["summary"] == (
        "rank 2 (node3) is stuck in load_batch (train.py:10) while rank 0 waits in all_reduce; "
        "rank 1 (node2) has no stacks: py-spy found no thread"
    )


def test_a_rank_without_frames_is_still_the_one_the_others_wait_for_when_none_is_seen_stuck():
    finding = hang_finding(_job(WAITING, [], WAITING))

    assert (finding["stuck_ranks"], finding["waiting_ranks"]) == ([1], [0, 2])
