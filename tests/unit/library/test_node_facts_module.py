"""The node_facts module on a real node: a runtime with no daemon (Charliecloud) asks no Docker daemon."""

import json

from tests.support.ansible import ansible_env, run_ansible

JSON_RESULTS = {"ANSIBLE_CALLBACK_RESULT_FORMAT": "json", "ANSIBLE_CALLBACK_FORMAT_PRETTY": "0"}


def _node_facts(args, tmp_path):
    argv = ["ansible", "localhost", "-c", "local", "-m", "node_facts", "-a", json.dumps(args)]
    # No daemon answers here: whatever asks one fails.
    completed = run_ansible(argv, env=ansible_env(DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock", **JSON_RESULTS))
    return completed, json.loads(completed.stdout[completed.stdout.index("=>") + 2 :])


def test_a_node_of_a_runtime_with_no_daemon_takes_part_with_no_docker_version(tmp_path):
    args = {"node": "node1", "results_dir": str(tmp_path), "job_id": "42", "container_runtime": "charliecloud"}
    completed, facts = _node_facts(args, tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert facts["docker_version"] is None and facts["node_dir"].endswith("/42/attempt-0/nodes/node1")


def test_a_docker_node_whose_daemon_does_not_answer_cannot_take_part(tmp_path):
    completed, facts = _node_facts({"node": "node1", "results_dir": str(tmp_path), "job_id": "42"}, tmp_path)
    assert completed.returncode != 0 and "Docker on node1 is not reachable" in facts["msg"], facts
