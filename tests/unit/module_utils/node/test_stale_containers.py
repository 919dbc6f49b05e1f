"""The stale-container cleanup: which of this user's containers on a node may go, and only those.

The decision (`judge_container`) is a pure function of the container's labels and what is known about SLURM jobs
and processes; the cleanup itself runs against the session's private Docker daemon.
"""

import os
import shutil
import subprocess
import time
import uuid

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import (
    GONE,
    NodeView,
    boot_id,
    judge_container,
    owner_labels,
    parse_squeue_states,
    pid_namespace,
    process_start,
    remove_stale_containers,
    slurm_job_states,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import container_labels

UID = 1000
NODE = NodeView(uid=UID, boot_id="boot-a", pid_namespace="pid:[1]")


def _slurm_labels(job, uid=UID):
    return {
        "slurm-multi.job": job,
        "slurm-multi.user": "tester",
        "slurm-multi.uid": str(uid),
        "slurm-multi.slurm_job": job,
        "slurm-multi.pid": "4000",
        "slurm-multi.pid_start": "77",
        "slurm-multi.boot_id": "boot-a",
        "slurm-multi.pid_ns": "pid:[1]",
    }


def _local_labels(pid=4000, start="77", boot="boot-a", ns="pid:[1]"):
    return {
        "slurm-multi.job": "local-20261130120000",
        "slurm-multi.user": "tester",
        "slurm-multi.uid": str(UID),
        "slurm-multi.pid": str(pid),
        "slurm-multi.pid_start": start,
        "slurm-multi.boot_id": boot,
        "slurm-multi.pid_ns": ns,
    }


def _judge(labels, job_states=None, live=None, node=NODE):
    return judge_container("c", labels, node, "tester", job_states or {}, live or {})


# --- SLURM jobs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"])
def test_a_container_of_an_ended_slurm_job_is_stale(state):
    verdict = _judge(_slurm_labels("4242"), {"4242": state})
    assert verdict.stale and verdict.ours
    assert "4242 has ended" in verdict.reason and state in verdict.reason


def test_a_container_of_a_job_slurm_no_longer_knows_is_stale():
    assert _judge(_slurm_labels("4242"), {"4242": GONE}).stale


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", "COMPLETING", "SUSPENDED", "CONFIGURING", "REQUEUED"])
def test_a_container_of_a_live_slurm_job_is_kept(state):
    verdict = _judge(_slurm_labels("4242"), {"4242": state})
    assert not verdict.stale and state in verdict.reason


def test_a_container_of_a_slurm_job_in_an_unknown_state_is_kept_with_a_warning():
    verdict = _judge(_slurm_labels("4242"), {})
    assert not verdict.stale and verdict.worth_a_warning
    assert "unknown" in verdict.reason


def test_job_ids_match_exactly_never_as_prefixes_or_steps():
    # The old cleanup compared strings from `squeue -u`: 4242 running did not save "4242.2", and "42" was no help.
    assert not _judge(_slurm_labels("4242.2"), {"4242": "RUNNING"}).stale
    assert _judge(_slurm_labels("42"), {"4242": "RUNNING", "42": "COMPLETED"}).stale
    assert not _judge(_slurm_labels("4242"), {"42": "COMPLETED", "4242": "RUNNING"}).stale


def test_a_container_of_an_earlier_attempt_of_this_very_job_is_stale():
    # SLURM keeps a requeued job's ID; the earlier attempt's container holds the name the new attempt needs.
    node = NodeView(uid=UID, boot_id="boot-a", pid_namespace="pid:[1]", slurm_job="4242", attempt=1)
    earlier = {**_slurm_labels("4242"), "slurm-multi.attempt": "0"}
    verdict = _judge(earlier, {"4242": "RUNNING"}, node=node)
    assert verdict.stale and "attempt 0" in verdict.reason
    assert not _judge({**earlier, "slurm-multi.attempt": "1"}, {"4242": "RUNNING"}, node=node).stale
    assert not _judge(earlier, {"4242": "RUNNING"}, node=NodeView(UID, "boot-a", "pid:[1]", "4243", 1)).stale


def test_a_slurm_container_whose_owner_process_died_is_kept_while_the_job_runs():
    # SLURM may give steps their own PID namespace: a pid is not trusted inside a job, only the job's state.
    assert not _judge(_slurm_labels("4242"), {"4242": "RUNNING"}, live={}).stale


# --- runs outside SLURM -----------------------------------------------------------------------------------------


def test_a_local_run_whose_owner_is_alive_is_kept():
    verdict = _judge(_local_labels(), live={4000: "77"})
    assert not verdict.stale and "alive" in verdict.reason


def test_a_local_run_whose_owner_is_gone_is_stale():
    verdict = _judge(_local_labels(), live={})
    assert verdict.stale and "pid 4000" in verdict.reason


def test_a_local_run_whose_pid_now_names_another_process_is_stale():
    assert _judge(_local_labels(start="77"), live={4000: "999"}).stale


def test_a_local_run_from_before_the_last_boot_is_stale_even_if_its_pid_is_alive_again():
    assert _judge(_local_labels(boot="boot-old"), live={4000: "77"}).stale


def test_a_local_run_in_another_pid_namespace_is_kept():
    assert not _judge(_local_labels(ns="pid:[2]"), live={}).stale


def test_a_local_run_without_a_boot_id_or_pid_is_kept():
    labels = _local_labels()
    del labels["slurm-multi.boot_id"]
    assert not _judge(labels).stale
    labels = _local_labels()
    labels["slurm-multi.pid"] = "not-a-pid"
    assert not _judge(labels).stale


# --- whose containers ---------------------------------------------------------------------------------------------


def test_another_uids_container_is_never_ours():
    verdict = _judge(_slurm_labels("4242", uid=UID + 1), {"4242": "COMPLETED"})
    assert not verdict.stale and not verdict.ours


def test_a_container_from_before_the_owner_labels_is_left_alone_with_a_warning():
    verdict = _judge({"slurm-multi.job": "4242", "slurm-multi.user": "tester"}, {"4242": "COMPLETED"})
    assert not verdict.stale and verdict.ours and verdict.worth_a_warning
    assert "docker rm -f c" in verdict.reason
    assert not _judge({"slurm-multi.job": "4242", "slurm-multi.user": "someone"}).ours


# --- squeue's answer ----------------------------------------------------------------------------------------------


def test_squeue_answers_by_exact_id_and_a_missing_id_has_ended():
    states = parse_squeue_states(["42", "4242"], 0, "4242 RUNNING\n", "")
    assert states == {"42": GONE, "4242": "RUNNING"}


def test_squeue_on_one_id_slurm_does_not_know_has_ended():
    stderr = "slurm_load_jobs error: Invalid job id specified\n"
    assert parse_squeue_states(["4242"], 1, "", stderr) == {"4242": GONE}


@pytest.mark.parametrize(
    "stderr",
    [
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n",
        "squeue: error: Socket timed out on send/recv operation\n",
    ],
)
def test_a_failing_squeue_answers_for_no_job(stderr):
    assert parse_squeue_states(["4242"], 1, "", stderr) == {}


def test_squeue_failing_on_several_ids_answers_for_none_of_them():
    stderr = "slurm_load_jobs error: Invalid job id specified\n"
    assert parse_squeue_states(["42", "4242"], 1, "", stderr) == {}


def test_no_squeue_at_all_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    states, problem = slurm_job_states(["4242"])
    assert states == {} and "squeue" in problem


# --- the owner's identity ----------------------------------------------------------------------------------------


def test_owner_labels_name_this_process_its_boot_and_its_job():
    labels = owner_labels({"SLURM_JOB_ID": "4242"})
    assert labels["slurm-multi.uid"] == str(os.geteuid())
    assert labels["slurm-multi.slurm_job"] == "4242" and labels["slurm-multi.attempt"] == "0"
    assert owner_labels({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"})["slurm-multi.attempt"] == "2"
    assert labels["slurm-multi.pid"] == str(os.getpid())
    assert labels["slurm-multi.pid_start"] == process_start(os.getpid()) != ""
    assert labels["slurm-multi.boot_id"] == boot_id() != ""
    assert labels["slurm-multi.pid_ns"] == pid_namespace() != ""
    assert owner_labels({})["slurm-multi.slurm_job"] == owner_labels({})["slurm-multi.attempt"] == ""


def test_a_model_container_carries_its_owner_labels():
    labels = container_labels("local-1", 0, "tester", "dummy", {})
    assert labels["slurm-multi.job"] == "local-1" and labels["slurm-multi.pid"] == str(os.getpid())


def test_a_reaped_process_has_no_start_time():
    child = subprocess.Popen(["true"])
    child.wait()
    assert process_start(child.pid) is None


# --- the cleanup on a real daemon ----------------------------------------------------------------------------------


@pytest.fixture
def docker_host(private_dockerd, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    return private_dockerd


@pytest.fixture
def create(docker_host, busybox_image):
    """create(name, labels): a container on the private daemon; every one is removed afterwards."""
    names = []

    def make(labels):
        name = f"slurm-multi-t{uuid.uuid4().hex[:8]}-r0"
        argv = ["create", "--name", name]
        for key, value in labels.items():
            argv += ["--label", f"{key}={value}"]
        docker_host.docker(*argv, busybox_image[0], "true")
        names.append(name)
        return name

    yield make
    for name in names:
        docker_host.docker("rm", "-f", name, check=False)


def _names(docker_host):
    return docker_host.docker("ps", "-a", "--format", "{{.Names}}").stdout.split()


def _here(pid, **labels):
    """Owner labels of a run outside SLURM by `pid` on this node."""
    return {"slurm-multi.job": "local-x", "slurm-multi.user": "tester", **owner_labels({}, pid=pid), **labels}


def test_the_cleanup_keeps_a_live_local_run_and_removes_a_dead_ones(create, docker_host):
    live = create(_here(os.getpid()))
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    dead = create(_here(dead_owner.pid, **{"slurm-multi.pid_start": "1"}))

    cleanup = remove_stale_containers("tester")

    assert [v.name for v in cleanup.removed] == [dead]
    assert live in [v.name for v in cleanup.kept]
    assert live in _names(docker_host) and dead not in _names(docker_host)


def test_the_cleanup_keeps_slurm_jobs_it_cannot_ask_about_and_warns(create, docker_host, monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").symlink_to(shutil.which("docker"))
    monkeypatch.setenv("PATH", str(bin_dir))  # docker, but no squeue
    name = create(_here(os.getpid(), **{"slurm-multi.slurm_job": "999999999"}))

    cleanup = remove_stale_containers("tester")

    assert name in [v.name for v in cleanup.kept] and name in _names(docker_host)
    assert any("unknown" in w for w in cleanup.warnings) and any("squeue" in w for w in cleanup.warnings)


def test_the_cleanup_leaves_other_uids_and_old_containers_alone(create, docker_host):
    other = create({**_here(999999), "slurm-multi.uid": str(os.geteuid() + 1)})
    old = create({"slurm-multi.job": "4242", "slurm-multi.user": "tester"})

    cleanup = remove_stale_containers("tester", check_mode=False)

    assert cleanup.removed == []
    assert other in _names(docker_host) and old in _names(docker_host)
    assert [v.name for v in cleanup.kept if v.worth_a_warning] == [old]


def test_check_mode_removes_nothing(create, docker_host):
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    dead = create(_here(dead_owner.pid, **{"slurm-multi.pid_start": "1"}))

    cleanup = remove_stale_containers("tester", check_mode=True)

    assert dead in [v.name for v in cleanup.removed] and dead in _names(docker_host)


@pytest.fixture
def ended_and_live_jobs(lab_cluster):
    """(ID of a job that has ended, ID of a running job) on the lab; the running one is cancelled afterwards."""

    def sbatch(*argv):
        submitted = subprocess.run(
            ["sbatch", "--parsable", "-N1", "-o", "/dev/null", *argv], capture_output=True, text=True, timeout=300
        )
        assert submitted.returncode == 0, submitted.stderr
        return submitted.stdout.strip().split(";")[0]

    ended = sbatch("--wait", "--wrap", "true")
    live = sbatch("--wrap", "sleep 300")
    try:
        deadline = time.monotonic() + 120
        while slurm_job_states([live])[0].get(live) != "RUNNING":
            assert time.monotonic() < deadline, f"job {live} did not start within 120 s"
            time.sleep(0.5)
        yield ended, live
    finally:
        subprocess.run(["scancel", live], timeout=60)


@pytest.mark.lab
def test_slurm_is_asked_about_exact_job_ids(ended_and_live_jobs):
    ended, live = ended_and_live_jobs
    states, problem = slurm_job_states([ended, live, "999999999", f"{live}.2", "local-1"])

    assert problem is None
    assert states == {ended: "COMPLETED", live: "RUNNING", "999999999": GONE}


@pytest.mark.lab
def test_the_cleanup_removes_an_ended_jobs_container_and_keeps_a_running_jobs(ended_and_live_jobs, create, docker_host):
    ended, live = ended_and_live_jobs
    of_ended = create(_here(os.getpid(), **{"slurm-multi.slurm_job": ended}))
    of_live = create(_here(12345, **{"slurm-multi.slurm_job": live, "slurm-multi.pid_start": "1"}))

    cleanup = remove_stale_containers("tester")

    assert [(v.name, v.reason) for v in cleanup.removed] == [(of_ended, f"its SLURM job {ended} has ended (COMPLETED)")]
    assert of_live in _names(docker_host) and of_ended not in _names(docker_host)
