"""The collect_results task as the pipeline runs it: in Ansible's own worker (plugins/action/collect_results.py)."""

import json

from tests.support.ansible import ansible_env, run_ansible


def test_the_collect_starts_no_python_and_writes_the_record_of_a_job_no_node_reported(tmp_path):
    # A module would start an interpreter and unpack its payload (0.7-0.9 s of every job): here none can start.
    results = tmp_path / "results"
    results.mkdir(mode=0o755)
    args = {"results_dir": str(results), "job_id": "4242", "nodes": ["node1"]}
    argv = ["ansible", "localhost", "-c", "local", "-m", "collect_results", "-a", json.dumps(args)]
    env = ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_CALLBACK_FORMAT_PRETTY="0")
    collected = run_ansible([*argv, "-e", "ansible_python_interpreter=/bin/false"], env=env)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    result = json.loads(collected.stdout[collected.stdout.index("=>") + 2 :])
    assert result["status"] == "FAILURE" and "node1 (rank 0): no status.json" in result["reason"], result
    assert json.loads((results / "records" / "4242" / "attempt-0.json").read_text())["status"] == "FAILURE"
