"""Specification of the collect_results module, run by a real `ansible` on localhost."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VENV_PYTHON = sys.executable
SYSTEM_PYTHON = "/usr/bin/python3"


# Runs the module file as Ansible's debug entry point does (args as JSON on the command line), with the project's
# module_utils imported from this checkout's collections/: the module's real code, a second instead of an ansible run.
_DIRECT_RUN = (
    f"import runpy, sys; sys.path.insert(0, {str(ROOT / 'collections')!r}); "
    f"runpy.run_path({str(ROOT / 'library' / 'collect_results.py')!r}, run_name='__main__')"
)


def run_collect_results(args, check=False):
    """Run the module directly; return (exit code, the module's result)."""
    module_args = dict(args, _ansible_check_mode=check)
    done = subprocess.run(
        [VENV_PYTHON, "-c", _DIRECT_RUN, json.dumps({"ANSIBLE_MODULE_ARGS": module_args})],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip(), "the module printed no result:\n" + done.stderr
    return done.returncode, json.loads(done.stdout)


def run_collect_results_with_ansible(tmp_path, args, interpreter=VENV_PYTHON, module_itself=False):
    """Run the task through a real `ansible localhost`; return (exit code, ansible's output, the result).
    ``module_itself``: the module on ``interpreter``, as where its action plugin (the pipeline's) is not configured."""
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={interpreter}\n")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_INVENTORY_ENABLED="ini",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
    )
    if module_itself:
        env["ANSIBLE_ACTION_PLUGINS"] = str(tmp_path / "no-action-plugins")
    argv = [
        os.path.join(os.path.dirname(VENV_PYTHON), "ansible"),
        "localhost",
        "-i",
        str(inventory),
        "-m",
        "collect_results",
        "-a",
        json.dumps(args),
    ]
    done = subprocess.run(argv, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    _, _, result = done.stdout.partition("=> ")
    assert result, "no module result in ansible's output:\n" + done.stdout + done.stderr
    return done.returncode, done.stdout, json.loads(result)


def write_node(results_dir, node, rank, exit_code=0, log="", attempt=0):
    node_dir = results_dir / "42" / f"attempt-{attempt}" / "nodes" / node
    node_dir.mkdir(parents=True)
    status = {
        "node": node,
        "rank": rank,
        "status": "SUCCESS" if exit_code == 0 else "FAILURE",
        "exit_code": exit_code,
        "error_pattern": None,
        "aborted_by_rank": None,
        "cancelled": False,
        "timed_out": False,
        "perf_lines": log.count("performance:"),
        "reason": "",
    }
    (node_dir / "status.json").write_text(json.dumps(status))
    (node_dir / "run.log").write_text(log)


@pytest.fixture
def two_node_job(tmp_path):
    """A 2-node job whose worker (the last rank) printed the throughput."""
    results_dir = tmp_path / "results"
    write_node(results_dir, "node1", 0)
    write_node(results_dir, "node2", 1, log="[rank15]: performance: 10123.4 tok/s\n")
    return results_dir


def module_args(results_dir, **extra):
    args = {
        "results_dir": str(results_dir),
        "job_id": "42",
        "nodes": ["node1", "node2"],
        "model": {"name": "primus_llama", "n_gpus": 8, "tags": ["pyt"], "timeout": 3600},
    }
    args.update(extra)
    return args


def test_module_returns_the_verdict_and_writes_the_record(two_node_job):
    rc, result = run_collect_results(module_args(two_node_job))
    assert rc == 0 and result["changed"]
    assert result["status"] == "SUCCESS"
    assert result["perf_rows"] == [
        {"model": "primus_llama", "performance": "10123.4", "metric": "tok/s", "status": "SUCCESS"}
    ]
    assert result["record_path"] == str(two_node_job / "records" / "42" / "attempt-0.json")
    assert result["job_record_path"] == str(two_node_job / "records" / "42.json") and result["attempt"] == 0
    assert (two_node_job / "perf.csv").is_file()


def test_failure_verdict_is_data_not_a_module_failure(two_node_job):
    (two_node_job / "42" / "attempt-0" / "nodes" / "node1" / "status.json").unlink()
    rc, result = run_collect_results(module_args(two_node_job))
    assert rc == 0 and not result.get("failed")
    assert result["status"] == "FAILURE" and "node1 (rank 0): no status.json" in result["reason"]
    assert result["per_node"]["node2"]["status"] == "SUCCESS"


def test_second_collect_of_the_same_job_reports_no_change(two_node_job):
    run_collect_results(module_args(two_node_job))
    rc, result = run_collect_results(module_args(two_node_job))
    assert rc == 0 and not result["changed"] and result["status"] == "SUCCESS"


def test_check_mode_decides_without_writing(two_node_job):
    rc, result = run_collect_results(module_args(two_node_job), check=True)
    assert rc == 0 and result["changed"] and result["status"] == "SUCCESS"
    assert not (two_node_job / "records").exists()


def test_skipped_results_csv_is_warned_about(two_node_job):
    (two_node_job / "42" / "attempt-0" / "nodes" / "node1" / "perf.csv").write_text("name,value\n")
    rc, result = run_collect_results(module_args(two_node_job))
    assert rc == 0
    # Ansible 2.19 modules return warnings as structured events; their text is what the user reads.
    assert "perf.csv skipped: missing column(s) model, performance, metric" in json.dumps(result["warnings"])


def test_bad_job_id_fails_with_a_message_saying_what_a_job_id_is(two_node_job):
    rc, result = run_collect_results(module_args(two_node_job, job_id="../42"))
    assert rc != 0 and result["failed"]
    assert "not a SLURM job ID" in result["msg"]


def test_module_runs_under_ansible_on_localhost(tmp_path, two_node_job):
    rc, _, result = run_collect_results_with_ansible(tmp_path, module_args(two_node_job))
    assert rc == 0 and result["status"] == "SUCCESS"


@pytest.mark.skipif(
    subprocess.run([SYSTEM_PYTHON, "-c", "import pandas"], capture_output=True).returncode == 0
    if os.path.exists(SYSTEM_PYTHON)
    else True,
    reason="needs a system python3 without pandas",
)
def test_interpreter_without_pandas_is_told_to_use_the_venv_once_a_results_csv_needs_it(tmp_path, two_node_job):
    # pandas is imported on first use: a job without results CSVs is collected by any python3.
    rc, _, result = run_collect_results_with_ansible(
        tmp_path, module_args(two_node_job), interpreter=SYSTEM_PYTHON, module_itself=True
    )
    assert rc == 0 and result["status"] == "SUCCESS", result

    csv_job = tmp_path / "csv-job"
    shutil.copytree(two_node_job, csv_job)
    shutil.rmtree(csv_job / "records", ignore_errors=True)
    (csv_job / "42" / "attempt-0" / "nodes" / "node1" / "perf_dummy.csv").write_text(
        "model,performance,metric\nx,1,s\n"
    )
    rc, output, result = run_collect_results_with_ansible(
        tmp_path, module_args(csv_job), interpreter=SYSTEM_PYTHON, module_itself=True
    )
    assert rc != 0 and "FAILED!" in output
    assert "venv interpreter" in result["msg"]
