"""node_play_problems: what the node plays' one guard checks, in push and pull mode; the stages' one argument spec."""

from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from plugins.filter.node_play import node_play_problems, stages_argument_options

ROOT = Path(__file__).resolve().parents[4]

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


def test_only_the_tasks_each_node_does_itself_fork_a_worker_per_node():
    # Ansible forks a worker per host for every task without run_once, even one the host skips (0.05-0.12 s of the
    # batch host's CPU per node and task). The rest run once: the controller's checks, rank 0's own tasks (rank 0 is
    # the play's first host) and the hand-ons, which set each node's facts from one worker (delegate_facts).
    roles = ROOT / "roles"
    files = [roles / role / "tasks" / "main.yml" for role in ("node_play_guards", "preflight", "preparation", "build")]
    files += [roles / "build" / "tasks" / f"{transport}.yml" for transport in ("cache", "registry")]
    files += [roles / "running" / "tasks" / "main.yml"]
    per_node = [
        f"{path.parent.parent.name}/{path.name}: {task['name']}"
        for path in files
        for task in yaml.safe_load(path.read_text())
        if not task.get("run_once") and task.get("delegate_to") != "localhost"
    ]
    assert per_node == [
        "preflight/main.yml: Check every node before anything expensive",
        "preparation/main.yml: Read the node's facts, make its results directory and remove this user's containers "
        "of ended runs",
        "build/main.yml: Hand rank 0's image to every node (the shared tar cache or the registry)",
        "build/cache.yml: Hand rank 0's image to every node through the shared tar cache",
        "build/registry.yml: Pull rank 0's image by its digest",
        "running/main.yml: Run the model on every node at once",
    ]


STAGES = ["node_play_guards", "preflight", "preparation", "build", "running"]


def test_the_play_checks_every_stages_options_in_one_validation():
    # One validate_argument_spec over the five roles' options (0.09 s of the batch host's CPU), not a loop of five
    # (0.23 s): an option several roles take is checked once.
    options = stages_argument_options(STAGES, str(ROOT / "roles"))
    each = [
        yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
        for role in STAGES
    ]
    assert set(options) == {name for spec in each for name in spec["options"]}
    play = yaml.safe_load((ROOT / "playbooks" / "run_multi.yml").read_text())[0]
    (check,) = [task for task in play["tasks"] if "ansible.builtin.validate_argument_spec" in task]
    assert "loop" not in check and check.get("run_once") is True
    assert "stages_argument_options" in check["ansible.builtin.validate_argument_spec"]["argument_spec"]
    assert all(f"'{role}'" in check["ansible.builtin.validate_argument_spec"]["argument_spec"] for role in STAGES)


def _role_spec(roles, role, **options):
    (roles / role / "meta").mkdir(parents=True)
    spec = {"argument_specs": {"main": {"options": options}}}
    (roles / role / "meta" / "argument_specs.yml").write_text(yaml.safe_dump(spec))


def test_two_roles_taking_one_option_differently_are_named_and_a_description_is_no_difference(tmp_path):
    _role_spec(tmp_path, "first", port={"type": "int", "description": "the first's words"})
    _role_spec(tmp_path, "second", port={"type": "int", "description": "the second's"}, name={"type": "str"})
    _role_spec(tmp_path, "third", port={"type": "str"})
    assert stages_argument_options(["first", "second"], str(tmp_path)) == {
        "port": {"type": "int", "description": "the first's words"},
        "name": {"type": "str"},
    }
    with pytest.raises(AnsibleFilterError, match="roles first and third take option port differently"):
        stages_argument_options(["first", "third"], str(tmp_path))
    with pytest.raises(AnsibleFilterError, match="cannot read the argument spec of role missing"):
        stages_argument_options(["missing"], str(tmp_path))
