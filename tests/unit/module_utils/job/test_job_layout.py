"""Specification of what every stage shares about a job: its ID rule, the status.json schema, the atomic writer."""

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import (
    FAILURE,
    STATUS_FIELDS,
    JobLayoutError,
    local_run_id,
    new_status,
    stage_failure_status,
    validate_job_id,
    write_status,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import decide_verdict
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import write_file_atomically
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    allocation_from_env,
)
from plugins.filter.job_layout import job_id_for_run
from tests.support.ansible import ROOT, run_ansible

CONTRACTS = ROOT / "docs" / "contracts.md"


# ------------------------------------------------------------------------------------------------- the job ID


@pytest.mark.parametrize("job_id", ["4242", "4242_7", "4242+1", "4242.2", "local-20261130120000-ab12"])
def test_one_rule_takes_slurms_ids_a_local_runs_and_a_users(job_id):
    assert validate_job_id(job_id) == job_id


@pytest.mark.parametrize("job_id", ["", ".", "..", ".hidden", "../etc", "a/b", "-x", "_4242", "+1", "42 42"])
def test_an_id_that_could_escape_a_dir_or_pass_for_an_option_is_refused(job_id):
    with pytest.raises(JobLayoutError, match="not a SLURM job ID or a local run's"):
        validate_job_id(job_id)


def test_a_local_run_id_is_local_time_and_a_random_suffix():
    assert re.match(r"^local-\d{14}-[0-9a-f]{4}$", local_run_id())
    assert local_run_id(now=0, suffix="ab12").endswith("-ab12")
    validate_job_id(local_run_id())


def test_the_role_and_the_api_name_a_run_outside_slurm_alike():
    # The preparation role takes its job ID through this filter; the API through job_layout.job_id_for_run.
    for job_id in (job_id_for_run(""), job_id_for_run(None), job_layout.job_id_for_run(None)):
        assert re.match(r"^local-\d{14}-[0-9a-f]{4}$", job_id), job_id
    assert job_id_for_run(4242) == "4242"


@pytest.mark.parametrize("slurm_job_id", ["4242", "4242_7", "4242+1"])
def test_the_allocation_takes_every_job_id_slurm_gives(slurm_job_id):
    allocation = allocation_from_env({"SLURM_JOB_ID": slurm_job_id, "SLURM_JOB_NODELIST": "node[1-2]"})
    assert allocation.job_id == slurm_job_id
    assert 1024 < allocation.master_port < 65536


def test_two_array_tasks_of_one_job_get_different_rendezvous_ports():
    ports = {
        allocation_from_env({"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "n1"}).master_port
        for job_id in ("4242_7", "4242_8")
    }
    assert len(ports) == 2


def test_the_allocation_refuses_a_job_id_slurm_never_gives():
    with pytest.raises(AllocationError, match="SLURM_JOB_ID='local-1'"):
        allocation_from_env({"SLURM_JOB_ID": "local-1", "SLURM_JOB_NODELIST": "n1"})


def test_no_other_file_has_a_job_id_rule_of_its_own():
    # One rule (job_layout), built on SLURM's own job numbers (slurm/allocation): a second regex for job IDs is how
    # the three checks came to disagree.
    pattern = re.compile(r"JOB_ID\w* = re\.compile")
    homes = {ROOT / "module_utils" / "job" / "layout.py", ROOT / "module_utils" / "slurm" / "allocation.py"}
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("module_utils", "library", "plugins", "slurm_multi")
        for path in (ROOT / folder).rglob("*.py")
        if path not in homes and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


# ------------------------------------------------------------------------------------------------ status.json


def _documented_status_fields():
    text = CONTRACTS.read_text(encoding="utf-8")
    section = text[text.index("`status.json` (one per node") : text.index("Secret values (the job")]
    return re.findall(r'"(\w+)":', section)


def test_contracts_document_exactly_the_status_fields_of_the_schema():
    documented = _documented_status_fields()
    assert sorted(documented) == sorted(STATUS_FIELDS), (
        "docs/contracts.md's status.json section and job_layout.STATUS_FIELDS disagree: "
        f"undocumented {sorted(set(STATUS_FIELDS) - set(documented))}, "
        f"not in the schema {sorted(set(documented) - set(STATUS_FIELDS))}"
    )
    assert len(documented) == len(set(documented))


def test_stopped_by_other_node_is_in_the_contract():
    assert "stopped_by_other_node" in _documented_status_fields()


def test_a_field_the_schema_does_not_know_is_never_written(tmp_path):
    with pytest.raises(JobLayoutError, match="no field gpu_temperature"):
        new_status("node1", 0, 2, "42", "dummy", gpu_temperature=80)
    status = dict(new_status("node1", 0, 2, "42", "dummy"), gpu_temperature=80)
    with pytest.raises(JobLayoutError, match="STATUS_FIELDS"):
        write_status(str(tmp_path / "status.json"), status)
    assert not (tmp_path / "status.json").exists()


def test_a_new_status_has_every_field_a_run_writes(tmp_path):
    status = new_status("node1", 0, 2, 42, "dummy", started_at=1.0)
    assert set(status) == set(STATUS_FIELDS) - set(job_layout.RESCUE_STATUS_FIELDS)
    assert status["job_id"] == "42" and status["status"] == "SUCCESS"
    write_status(str(tmp_path / "status.json"), status)
    assert json.loads((tmp_path / "status.json").read_text()) == status


def test_the_rescue_blames_the_failing_node_and_not_the_ones_it_stopped():
    failed = stage_failure_status("node1", 0, 2, "42", "dummy", "build", error="docker build failed")
    stopped = stage_failure_status("node2", 1, 2, "42", "dummy", "build")
    assert failed["reason"] == "the build stage failed on node1: docker build failed"
    assert (failed["stopped_by_other_node"], stopped["stopped_by_other_node"]) == (False, True)
    assert stopped["reason"] == "stopped during the build stage because another node failed"
    verdict = decide_verdict({"node1": failed, "node2": stopped}, [], ["node1", "node2"])
    assert verdict.per_node["node1"]["root_cause"] and not verdict.per_node["node2"]["root_cause"]
    assert verdict.status == FAILURE


def test_a_failed_stages_rescue_writes_statuses_of_the_schema(tmp_path):
    """The real rescue tasks (record_stage_failure.yml) in a real play: node1 fails, node2 is stopped."""
    playbook = tmp_path / "rescue.yml"
    playbook.write_text(
        """
- hosts: all
  gather_facts: false
  any_errors_fatal: true
  vars_files:
    - GROUP_VARS
  vars:
    node_rank: "{{ ansible_play_hosts_all.index(inventory_hostname) }}"
  tasks:
    - block:
        - ansible.builtin.fail:
            msg: the registry refused the push
          when: inventory_hostname == 'node1'
        - ansible.builtin.pause:
            seconds: 1
      rescue:
        - ansible.builtin.include_role:
            name: postprocessing
            tasks_from: record_stage_failure
          vars:
            model_card: {name: dummy}
""".replace("GROUP_VARS", str(ROOT / "group_vars" / "all.yml"))
    )
    results = tmp_path / "results"
    extra = {
        "results_dir": str(results),
        "job_id": "4242",
        "job_attempt": 0,
        "nnodes": 2,
        "pipeline_stage": "build",
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
    }
    result = run_ansible(["ansible-playbook", "-i", "node1,node2,", str(playbook), "-e", json.dumps(extra)])
    statuses = {
        node: json.loads((results / "4242" / "attempt-0" / "nodes" / node / "status.json").read_text())
        for node in ("node1", "node2")
    }
    assert all(set(status) == set(STATUS_FIELDS) for status in statuses.values()), (statuses, result.stdout[-2000:])
    assert statuses["node1"]["reason"] == "the build stage failed on node1: the registry refused the push"
    assert (statuses["node1"]["rank"], statuses["node2"]["rank"]) == (0, 1)
    assert (statuses["node1"]["stopped_by_other_node"], statuses["node2"]["stopped_by_other_node"]) == (False, True)
    assert statuses["node2"]["stage"] == "build" and statuses["node2"]["model"] == "dummy"


# ------------------------------------------------------------------------------------------------- the writer


def test_the_atomic_writer_makes_the_file_and_its_new_name_durable(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_file_atomically(str(tmp_path / "record.json"), b"{}\n", 0o640)
    assert synced == ["file", "dir"]
    assert (tmp_path / "record.json").read_bytes() == b"{}\n"
    assert stat.S_IMODE((tmp_path / "record.json").stat().st_mode) == 0o640
    assert [path.name for path in tmp_path.iterdir()] == ["record.json"]


def test_the_atomic_writer_replaces_a_planted_symlink_without_following_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "status.json").symlink_to(target)
    write_file_atomically(str(tmp_path / "status.json"), b"new", 0o644)
    assert target.read_text() == "keep"
    assert not (tmp_path / "status.json").is_symlink() and (tmp_path / "status.json").read_bytes() == b"new"


# ------------------------------------------------------------------------------------------------- ABORT marker


def test_a_marker_that_is_not_a_json_object_still_stops_the_run_with_its_content_as_reason(tmp_path):
    Path(job_layout.abort_marker_path(str(tmp_path))).write_text("[1, 2]")
    assert read_abort_marker(str(tmp_path)) == {"rank": None, "node": None, "reason": "[1, 2]"}


def test_the_abort_marker_appears_whole_so_no_reader_sees_it_half_written(tmp_path, monkeypatch):
    seen_while_writing = []
    real_dump = abort_marker.json.dump

    def dump_and_look(obj, handle):
        seen_while_writing.append(read_abort_marker(str(tmp_path)))  # a node polling the marker mid-write
        real_dump(obj, handle)

    monkeypatch.setattr(abort_marker.json, "dump", dump_and_look)
    assert write_abort_marker(str(tmp_path), 2, "node3", "container exited with code 1")
    assert seen_while_writing == [None]
    assert read_abort_marker(str(tmp_path)) == {"rank": 2, "node": "node3", "reason": "container exited with code 1"}
    assert os.listdir(tmp_path) == [job_layout.ABORT_MARKER]  # no temp file left behind


def test_the_first_abort_marker_stands_and_a_symlink_planted_there_is_never_written_through(tmp_path):
    assert write_abort_marker(str(tmp_path), 1, "node2", "first")
    assert not write_abort_marker(str(tmp_path), 0, "node1", "second")
    assert read_abort_marker(str(tmp_path))["reason"] == "first"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / job_layout.ABORT_MARKER).symlink_to(tmp_path / "victim")
    assert not write_abort_marker(str(planted), 0, "node1", "x")
    assert not (tmp_path / "victim").exists() and sorted(os.listdir(planted)) == [job_layout.ABORT_MARKER]


def test_a_results_file_is_the_cards_name_or_a_local_ranks_beside_it():
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import is_results_file

    names = ["perf.csv", "perf_rank0.csv", "perf_rank12.csv", "perf_rank.csv", "perf_rankA.csv", "xperf.csv"]
    assert [name for name in names if is_results_file(name, "out/perf.csv")] == names[:3]
    assert not is_results_file("perf.csv", "")
