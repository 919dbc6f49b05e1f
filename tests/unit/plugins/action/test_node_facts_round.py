"""The preflight stage's round reads the node's facts for the preparation stage, which hands them on with no round
of its own (library/node_preflight.py's node_facts, plugins/action/node_facts.py)."""

import json

from tests.support.ansible import ansible_env, run_ansible

FACTS = {"node_dir": "/shared/results/42/attempt-0/nodes/node1", "gpu_vendor": "none", "gpus": [], "changed": False}
NO_PYTHON = ["-e", "ansible_python_interpreter=/bin/false"]
JSON_RESULTS = {"ANSIBLE_CALLBACK_RESULT_FORMAT": "json", "ANSIBLE_CALLBACK_FORMAT_PRETTY": "0"}


def _result(completed):
    """The one host's result of an ad-hoc `ansible localhost` run ("localhost | STATUS => {...}")."""
    return json.loads(completed.stdout[completed.stdout.index("=>") + 2 :])


def _node_facts(args, *extra):
    argv = ["ansible", "localhost", "-c", "local", "-m", "node_facts", "-a", json.dumps(args), *extra]
    return run_ansible(argv, env=ansible_env(**JSON_RESULTS))


def test_facts_the_preflight_round_read_are_handed_on_without_a_round_on_the_node(tmp_path):
    args = {"node": "node1", "results_dir": str(tmp_path), "job_id": "42", "read_by_preflight": FACTS}
    handed = _node_facts(args, *NO_PYTHON)
    assert handed.returncode == 0, handed.stdout + handed.stderr
    assert _result(handed)["node_dir"] == FACTS["node_dir"]


def test_a_node_the_preflight_round_could_not_read_fails_the_preparation_task_with_its_reason(tmp_path):
    read = {"failed": True, "msg": "Docker on node1 is not reachable (no socket); start dockerd on node1"}
    args = {"node": "node1", "results_dir": str(tmp_path), "job_id": "42", "read_by_preflight": read}
    failed = _node_facts(args, *NO_PYTHON)
    assert failed.returncode != 0
    assert "Docker on node1 is not reachable" in _result(failed)["msg"], failed.stdout


def test_the_preflight_round_passes_a_fit_node_that_cannot_take_part_and_says_why(tmp_path):
    # Docker is not one of the checks here, so the checks pass; the facts' own Docker call then fails.
    facts = {"node": "node1", "results_dir": str(tmp_path), "job_id": "42", "remove_stale_containers": True}
    args = {
        "node": "node1",
        "checks": [],
        "results_dir": str(tmp_path),
        "attempt_dir": str(tmp_path / "42" / "attempt-0"),
        "node_facts": facts,
    }
    argv = ["ansible", "localhost", "-c", "local", "-m", "node_preflight", "-a", json.dumps(args)]
    checked = run_ansible(argv, env=ansible_env(DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock", **JSON_RESULTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    read = _result(checked)["node_facts"]
    assert read["failed"] is True and "Docker on node1 is not reachable" in read["msg"], read
