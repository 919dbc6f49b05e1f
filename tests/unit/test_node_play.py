"""node_play_problems: what the node plays' one guard checks, in push and pull mode."""

from plugins.filter.node_play import node_play_problems

NODES = ["node1", "node2", "node3"]


def test_a_push_play_over_every_node_at_once_with_a_fork_each_has_no_problem():
    assert node_play_problems("push", NODES, NODES, NODES, 3) == []


def test_push_mode_names_a_left_out_node_serial_batches_and_too_few_forks_together():
    problems = node_play_problems("push", NODES, NODES[:2], NODES[:1], 2)
    assert len(problems) == 3
    assert "Drop --limit" in problems[0] and "node1, node2, node3" in problems[0]
    assert "remove `serial`" in problems[1]
    assert "Run with -f 3" in problems[2]


def test_a_push_play_whose_first_host_is_not_rank_0_says_how_to_order_it():
    # Rank 0's own tasks (the build) run once, on the play's first host.
    (problem,) = node_play_problems("push", NODES, NODES[::-1], NODES[::-1], 3)
    assert "Rank 0 (node1)" in problem and "node3 is" in problem and "primary:workers" in problem


def test_a_pull_play_on_its_own_node_with_the_token_has_no_problem():
    assert node_play_problems("pull", NODES, ["node2"], ["node2"], 1, "node2", True) == []


def test_a_pull_play_outside_the_pull_step_says_how_to_start_it():
    (outside,) = node_play_problems("pull", NODES, NODES, NODES, 3, "", False)
    assert "SLURMD_NODENAME is unset" in outside and "slurm-multi submit --mode pull" in outside
    (no_token,) = node_play_problems("pull", NODES, ["node2"], ["node2"], 1, "node2", False)
    assert "MAD_BARRIER_TOKEN" in no_token


def test_an_unknown_mode_is_named():
    (problem,) = node_play_problems("pul", NODES, NODES, NODES, 3)
    assert "'pul'" in problem and "push" in problem and "pull" in problem
