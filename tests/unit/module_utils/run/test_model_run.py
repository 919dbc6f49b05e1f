"""The run of one node's model container to its verdict, against a real (private) Docker daemon.

Several ranks of one job are several concurrent calls of the run logic (threads) against the same daemon.
"""

import hashlib
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import BarrierFailed
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.node import (
    NodeAtBarrier,
    meet_every_node,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import beating, node_liveness
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.cancellation import Cancellation
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import (
    COMMAND_PREFIX,
    ENV_FILE_PREFIX,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import STACKS_JSON
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import HANG_KIND
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import _file_signature
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import (
    run_model_container as run_under,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRunError,
    plan_model_run,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.docker.rank import DockerRuntime
from tests.support.container_command import argv_matches, recorded_argv
from tests.support.lab.model_runs import read_json, secrets_file

# The fixtures docker_host, model_dir, job_id and make_run.
pytest_plugins = ("tests.support.lab.model_run_fixtures",)


def run_model_container(run, *args, **kwargs):
    """The run under Docker, the runtime of every test here."""
    return run_under(run, *args, runtime=DockerRuntime(), **kwargs)


# ---------------------------------------------------------------------------------------------------- success


def test_a_successful_model_gets_a_success_status_with_its_perf_lines(make_run):
    outcome = run_model_container(make_run("perf.sh"))

    status = read_json(outcome.status_path)
    assert status["status"] == SUCCESS
    assert status["exit_code"] == 0 and status["perf_lines"] == 1 and status["reason"] == ""
    assert outcome.started and outcome.diagnostics_path is None


def test_the_status_file_follows_the_contract_schema(make_run, job_id):
    outcome = run_model_container(make_run("perf.sh", rank=1, nnodes=2))

    status = read_json(outcome.status_path)
    assert set(status) == {
        "node",
        "rank",
        "nnodes",
        "job_id",
        "model",
        "status",
        "exit_code",
        "error_pattern",
        "aborted_by_rank",
        "cancelled",
        "timed_out",
        "perf_lines",
        "n_gpus",
        "reason",
        "started_at",
        "ended_at",
        "steps",
        "image_id",
        "container_runtime",
        "launcher",
        "hostname",
        "gpu_architecture",
        "provenance",
        "hang",
        "tools",
        "tool_outputs",
    }
    assert (status["hang"], status["tools"], status["tool_outputs"]) == (False, [], [])
    assert status["image_id"].startswith("sha256:") and status["launcher"] == "slurm_multi"
    assert status["container_runtime"] == "docker"
    assert (status["node"], status["rank"], status["nnodes"], status["job_id"]) == ("node1", 1, 2, job_id)
    assert status["ended_at"] >= status["started_at"]


def test_the_status_keeps_the_earlier_steps_and_adds_the_runs_own_in_order(make_run):
    before = time.time()
    earlier = {"load": {"start": before - 9.0, "end": before - 5.0}, "barrier": {"start": before - 5.0, "end": before}}
    outcome = run_model_container(make_run("perf.sh", steps=earlier))

    steps = read_json(outcome.status_path)["steps"]
    assert list(steps) == ["barrier", "container_start", "load", "run"]  # the file's keys are sorted
    assert steps["load"] == earlier["load"] and steps["barrier"] == earlier["barrier"]
    start, run = steps["container_start"], steps["run"]
    assert before <= start["start"] <= start["end"] <= run["start"] <= run["end"] <= time.time()
    assert "diagnostics" not in steps  # a successful run takes no snapshot


def test_a_failed_run_records_its_diagnostics_step(make_run):
    outcome = run_model_container(make_run("crash.sh"))

    steps = read_json(outcome.status_path)["steps"]
    assert outcome.diagnostics_path is not None
    assert steps["run"]["end"] <= steps["diagnostics"]["start"] <= steps["diagnostics"]["end"]


def test_the_node_log_holds_the_container_output(make_run, tmp_path, job_id):
    outcome = run_model_container(make_run("perf.sh"))

    assert outcome.log_path == str(tmp_path / "results" / job_id / "attempt-0" / "nodes" / "node0" / "run.log")
    assert "performance: 42 samples_per_second" in Path(outcome.log_path).read_text()


def test_the_container_sees_the_multi_node_environment(make_run):
    outcome = run_model_container(make_run("perf.sh", rank=2, nnodes=3, master_addr="127.0.0.5", master_port=31234))

    assert "NODE_RANK=2 NNODES=3 MASTER_ADDR=127.0.0.5 MASTER_PORT=31234" in Path(outcome.log_path).read_text()


def test_model_args_reach_the_model_literally_and_nothing_runs_them(make_run, model_dir, tmp_path):
    hostile = [
        f"$(touch {tmp_path}/host_ran)",
        "$(touch /myworkspace/container_ran)",
        "`touch /myworkspace/backtick_ran`",
        "; touch /myworkspace/semicolon_ran",
        "{{ lookup('pipe', 'touch /myworkspace/jinja_ran') }}",
    ]
    args = " ".join("'" + arg.replace("'", "'\"'\"'") + "'" for arg in hostile)

    outcome = run_model_container(make_run("perf.sh", model_args=args))

    log = Path(outcome.log_path).read_text()
    assert [f"arg<{arg}>" for arg in hostile] == [line for line in log.splitlines() if line.startswith("arg<")]
    assert not (tmp_path / "host_ran").exists()
    assert sorted(p.name for p in model_dir.iterdir() if p.name.endswith("_ran")) == []


def test_context_mounts_are_mounted_into_the_container(make_run, tmp_path):
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "shard-0001.bin").write_text("x")

    outcome = run_model_container(make_run("list_data.sh", docker_mounts={"/data": str(data)}))

    assert "shard-0001.bin" in Path(outcome.log_path).read_text()


def test_the_results_csv_the_model_wrote_is_copied_into_the_node_dir(make_run):
    outcome = run_model_container(make_run("csv.sh", multiple_results="perf_dummy.csv"))

    assert Path(outcome.results_csv).name == "perf_dummy.csv"
    assert Path(outcome.results_csv).parent == Path(outcome.status_path).parent
    assert "dummy,42,samples_per_second" in Path(outcome.results_csv).read_text()


def test_each_local_ranks_results_csv_is_copied_beside_the_cards_name(make_run, model_dir):
    (model_dir / "perf_dummy_rankx.csv").write_text("not a rank's\n")
    outcome = run_model_container(make_run("csv_ranks.sh", multiple_results="perf_dummy.csv"))

    assert [Path(path).name for path in outcome.results_csvs] == ["perf_dummy_rank0.csv", "perf_dummy_rank1.csv"]
    assert "r1,41,samples_per_second" in Path(outcome.results_csvs[1]).read_text()
    assert outcome.results_csv == outcome.results_csvs[0]


def test_a_results_csv_left_over_from_an_earlier_run_is_not_copied(make_run, model_dir):
    (model_dir / "old.csv").write_text("model,performance,metric\nold,1,x\n")

    outcome = run_model_container(make_run("perf.sh", multiple_results="old.csv"))

    assert outcome.results_csv is None
    assert not (Path(outcome.status_path).parent / "old.csv").exists()


# ---------------------------------------------------------------------------------------------------- failures


def test_a_crashing_model_is_a_failure_status_not_an_error(make_run):
    outcome = run_model_container(make_run("crash.sh"))

    status = read_json(outcome.status_path)
    assert status["status"] == FAILURE
    assert status["exit_code"] == 3
    assert status["error_pattern"] == "RuntimeError:"
    assert "exited with code 3" in status["reason"] and "NCCL communicator broke" in status["reason"]


def test_an_error_pattern_fails_a_run_that_exited_zero(make_run):
    status = run_model_container(make_run("pattern_only.sh")).status

    assert (status["status"], status["exit_code"]) == (FAILURE, 0)
    assert status["error_pattern"] == "Traceback (most recent call last)"


def test_a_failing_rank_writes_the_abort_marker(make_run, tmp_path, job_id):
    run_model_container(make_run("crash.sh", rank=1, nnodes=2))

    marker = read_abort_marker(str(tmp_path / "results" / job_id / "attempt-0"))
    assert (marker["rank"], marker["node"]) == (1, "node1")
    assert "exited with code 3" in marker["reason"]


def test_a_failed_container_leaves_diagnostics_with_its_inspect_state_and_log_tail(make_run):
    outcome = run_model_container(make_run("crash.sh"))

    diagnostics = Path(outcome.diagnostics_path).read_text()
    assert Path(outcome.diagnostics_path).parent == Path(outcome.log_path).parent
    assert "ExitCode: 3" in diagnostics and "OOMKilled: False" in diagnostics
    assert "NCCL communicator broke" in diagnostics


def test_the_first_abort_marker_wins(tmp_path):
    assert write_abort_marker(str(tmp_path), 2, "node2", "first")
    assert not write_abort_marker(str(tmp_path), 0, "node0", "second")

    assert read_abort_marker(str(tmp_path)) == {"rank": 2, "node": "node2", "reason": "first"}


def test_when_one_rank_fails_the_others_stop_within_seconds(make_run):
    runs = [make_run("fail_later.sh" if rank == 1 else "hang.sh", rank=rank, nnodes=3) for rank in range(3)]
    outcomes, ended = {}, {}

    def run_rank(run):
        outcomes[run.rank] = run_model_container(run)
        ended[run.rank] = time.monotonic()

    threads = [threading.Thread(target=run_rank, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    for rank in (0, 2):
        status = outcomes[rank].status
        assert (status["status"], status["aborted_by_rank"]) == (FAILURE, 1)
        assert status["reason"].startswith("aborted because rank 1 (node1) failed: the container exited with code 1")
        assert ended[rank] - ended[1] < 10
    assert outcomes[1].status["aborted_by_rank"] is None


def test_a_rank_that_finds_the_abort_marker_before_starting_starts_nothing(make_run, tmp_path, job_id):
    (tmp_path / "results" / job_id / "attempt-0").mkdir(parents=True)
    write_abort_marker(str(tmp_path / "results" / job_id / "attempt-0"), 1, "node1", "image missing")

    outcome = run_model_container(make_run("hang.sh", rank=0, nnodes=2))

    assert not outcome.started
    assert outcome.status["aborted_by_rank"] == 1
    assert outcome.status["reason"] == "aborted because rank 1 (node1) failed: image missing"


def test_an_earlier_attempts_abort_marker_does_not_stop_a_requeued_run(make_run, tmp_path, job_id):
    # SLURM keeps the job ID on requeue: attempt 0's marker must not stop attempt 1.
    (tmp_path / "results" / job_id / "attempt-0").mkdir(parents=True)
    write_abort_marker(str(tmp_path / "results" / job_id / "attempt-0"), 1, "node1", "attempt 0 failed")

    outcome = run_model_container(make_run("perf.sh", rank=0, nnodes=2, attempt=1))

    assert outcome.started and outcome.status["status"] == "SUCCESS", outcome.status
    assert outcome.status["aborted_by_rank"] is None
    assert outcome.log_path == str(tmp_path / "results" / job_id / "attempt-1" / "nodes" / "node0" / "run.log")


def test_a_hung_model_is_stopped_at_its_timeout_with_a_process_table(make_run):
    outcome = run_model_container(make_run("hang.sh", timeout=1.5))

    status = read_json(outcome.status_path)
    assert (status["status"], status["timed_out"]) == (FAILURE, True)
    assert "timeout of 1.5 s" in status["reason"]
    diagnostics = Path(outcome.diagnostics_path).read_text()
    assert "== process table" in diagnostics and "sleep 1000" in diagnostics


def test_the_run_stops_the_margin_before_the_job_ends(make_run):
    outcome = run_model_container(make_run("hang.sh", job_end_time=time.time() + 61, end_margin=60))

    assert outcome.status["timed_out"]
    assert "stopped 60 s before its end" in outcome.status["reason"]


def test_a_cancelled_run_is_snapshotted_stopped_and_recorded(make_run):
    cancellation = Cancellation()
    threading.Timer(1.0, cancellation.request, args=("cancelled by SIGTERM",)).start()

    outcome = run_model_container(make_run("hang.sh"), cancellation)

    assert (outcome.status["cancelled"], outcome.status["reason"]) == (True, "cancelled by SIGTERM")
    assert "sleep 1000" in Path(outcome.diagnostics_path).read_text()


def test_a_rank_aborted_by_another_is_snapshotted_before_its_container_stops(make_run, tmp_path, job_id):
    run = make_run("hang.sh", rank=0, nnodes=2)
    threading.Timer(
        1.0, write_abort_marker, args=(run.attempt_dir, 1, "node1", "the container exited with code 1")
    ).start()

    outcome = run_model_container(run)

    assert outcome.status["aborted_by_rank"] == 1
    diagnostics = Path(outcome.diagnostics_path).read_text()
    assert "== process table" in diagnostics and "sleep 1000" in diagnostics  # taken while it still ran


def test_a_hung_rank_stops_its_container_only_once_the_other_nodes_took_their_stacks(make_run, tmp_path, job_id):
    run = make_run("hang.sh", rank=1, nnodes=2, allocation_nodes=["node0", "node1"])
    rank0_dir = Path(run.attempt_dir) / "nodes" / "node0"
    rank0_dir.mkdir(parents=True)
    threading.Timer(
        1.0, write_abort_marker, args=(run.attempt_dir, 0, "node0", "hung"), kwargs={"kind": HANG_KIND}
    ).start()
    rank0_took_its_stacks = {}

    def rank0_takes_its_stacks():
        rank0_took_its_stacks["at"] = time.monotonic()
        (rank0_dir / STACKS_JSON).write_text("{}")

    threading.Timer(4.0, rank0_takes_its_stacks).start()

    outcome = run_model_container(run)

    assert outcome.status["hang"] is True
    # Stopped after node0's stacks (at 4 s; the stop itself takes 1 s): node0's ranks were dumped still waiting, not
    # broken by this rank's end.
    assert "at" in rank0_took_its_stacks


def test_the_containers_end_is_seen_at_once_not_a_poll_later(make_run):
    started = time.monotonic()

    outcome = run_model_container(make_run("perf.sh", poll_interval=30))

    assert outcome.status["status"] == SUCCESS
    assert time.monotonic() - started < 15  # a poll of 30 s would have waited it out


# ---------------------------------------------------------------------------------------------------- rank 0 lost

# A model that outlives a quick rank 0 by seconds (the last rank often prints the job's figure).
SLOW_PERF = "sleep 4\necho 'performance: 7 samples_per_second'\n"


def test_a_worker_stops_its_container_once_rank0s_playbook_heartbeat_stood_still_naming_rank0(make_run):
    run = make_run("hang.sh", rank=1, nnodes=2, allocation_nodes=["node0", "node1"])
    rank0_dir = Path(run.attempt_dir) / "nodes" / "node0"
    rank0_dir.mkdir(parents=True)
    (rank0_dir / "playbook.alive").write_text("4242 1733150000.5\n")  # rank 0's playbook was killed
    started = time.monotonic()

    outcome = run_model_container(run, liveness=node_liveness(run.attempt_dir, run.allocation_nodes, 1, "playbook", 1))

    status = outcome.status
    assert (status["status"], status["aborted_by_rank"]) == (FAILURE, 0), status
    assert status["reason"].startswith("rank 0 (node0)'s playbook stopped its heartbeat"), status["reason"]
    assert time.monotonic() - started < 15 and status["exit_code"] is not None  # stopped, not left to hang
    assert read_abort_marker(run.attempt_dir) is None  # not the root cause: rank 0 is


def test_rank0_whose_own_playbook_died_stops_and_tells_the_workers(make_run):
    run = make_run("hang.sh", rank=0, nnodes=2, allocation_nodes=["node0", "node1"])
    Path(run.node_dir).mkdir(parents=True)
    (Path(run.node_dir) / "playbook.alive").write_text("4242 1733150000.5\n")  # its module lives on, orphaned

    outcome = run_model_container(run, liveness=node_liveness(run.attempt_dir, run.allocation_nodes, 0, "playbook", 1))

    assert (outcome.status["status"], outcome.status["aborted_by_rank"]) == (FAILURE, 0), outcome.status
    assert outcome.status["reason"].startswith("rank 0 (node0)'s own playbook stopped its heartbeat")
    marker = read_abort_marker(run.attempt_dir)
    assert (marker["rank"], marker["node"]) == (0, "node0") and marker["reason"] == outcome.status["reason"]


def test_a_quiet_rank0_whose_playbook_beats_does_not_stop_a_worker(make_run, model_dir):
    (model_dir / "slow_perf.sh").write_text(SLOW_PERF)
    run = make_run("slow_perf.sh", rank=1, nnodes=2, allocation_nodes=["node0", "node1"])
    rank0_dir = Path(run.attempt_dir) / "nodes" / "node0"
    rank0_dir.mkdir(parents=True)

    with beating(str(rank0_dir / "playbook.alive"), interval=0.2):  # rank 0's playbook, alive and silent
        outcome = run_model_container(
            run, liveness=node_liveness(run.attempt_dir, run.allocation_nodes, 1, "playbook", 1)
        )

    assert outcome.status["status"] == SUCCESS, outcome.status


def test_push_mode_rank0_beats_while_it_runs_and_a_worker_outliving_it_is_not_stopped(make_run, model_dir):
    """Rank 0's run module beats module.alive until it has written its status: a worker whose model runs on after
    rank 0's ended is not stopped for rank 0's beat standing still."""
    (model_dir / "slow_perf.sh").write_text(SLOW_PERF)
    nodes = ["node0", "node1"]
    scripts = ("perf.sh", "slow_perf.sh")
    runs = [make_run(script, rank=rank, nnodes=2, allocation_nodes=nodes) for rank, script in enumerate(scripts)]
    outcomes = {}

    def run_rank(run):
        liveness = node_liveness(run.attempt_dir, nodes, run.rank, "module", 1)
        outcomes[run.rank] = run_model_container(run, liveness=liveness)

    threads = [threading.Thread(target=run_rank, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert [outcomes[rank].status["status"] for rank in (0, 1)] == [SUCCESS, SUCCESS], outcomes
    beat = Path(runs[0].node_dir) / "module.alive"
    assert beat.read_text().split()[0] == str(os.getpid())
    assert not (Path(runs[1].node_dir) / "module.alive").exists()  # only rank 0 beats


# ---------------------------------------------------------------------------------------------------- launcher files

# Prints the hostfile deepspeed's runner names, as deepspeed would read it.
CAT_HOSTFILE = (
    'for word in $MAD_MULTI_NODE_RUNNER; do case "$word" in --hostfile=*) cat "${word#--hostfile=}";; esac; done\n'
    "echo 'performance: 1 samples_per_second'\n"
)


def deepspeed_run(make_run, model_dir):
    (model_dir / "cat_hostfile.sh").write_text(CAT_HOSTFILE)
    return make_run(
        "cat_hostfile.sh", nnodes=2, distributed={"launcher": "deepspeed"}, allocation_nodes=["node0", "node1"]
    )


def test_the_deepspeed_hostfile_is_a_job_file_the_container_reads_and_leaves_nothing_in_the_model_dir(
    make_run, model_dir
):
    run = deepspeed_run(make_run, model_dir)
    before = sorted(os.listdir(model_dir))

    outcome = run_model_container(run)

    assert outcome.status["status"] == SUCCESS, outcome.status
    assert "node0 slots=1\nnode1 slots=1\n" in Path(outcome.log_path).read_text()
    assert sorted(os.listdir(model_dir)) == before
    assert (Path(run.node_dir) / "deepspeed-hostfile").read_text() == "node0 slots=1\nnode1 slots=1\n"


def test_a_symlink_planted_at_the_old_hostfile_path_in_the_model_dir_is_not_followed(make_run, model_dir, tmp_path):
    """A group-writable zoo: another user plants a link where the hostfile used to be written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    (model_dir / ".slurm-multi-deepspeed-hostfile").symlink_to(victim)
    run = deepspeed_run(make_run, model_dir)

    outcome = run_model_container(run)

    assert outcome.status["status"] == SUCCESS, outcome.status
    assert victim.read_text() == "the user's own file\n"
    assert (model_dir / ".slurm-multi-deepspeed-hostfile").is_symlink()  # nothing of the user's is removed either


# ---------------------------------------------------------------------------------------------------- infrastructure


def test_a_missing_image_fails_the_call_and_tells_the_other_ranks(make_run, tmp_path, job_id):
    with pytest.raises(ModelRunError, match="image slurm-multi-test/absent:1 is not on node0"):
        run_model_container(make_run("perf.sh", nnodes=2, image="slurm-multi-test/absent:1"))

    status = read_json(tmp_path / "results" / job_id / "attempt-0" / "nodes" / "node0" / "status.json")
    assert status["status"] == FAILURE and status["exit_code"] is None
    assert read_abort_marker(str(tmp_path / "results" / job_id / "attempt-0"))["rank"] == 0


def test_an_unreachable_docker_daemon_fails_the_call(make_run, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")

    with pytest.raises(ModelRunError, match="no-daemon.sock"):
        run_model_container(make_run("perf.sh"))


def test_a_daemon_lost_during_the_run_still_leaves_the_run_step_in_the_status(
    make_run, docker_host, tmp_path, job_id, monkeypatch
):
    run = make_run("fail_later.sh")
    log = Path(run.node_dir) / "run.log"

    def lose_the_daemon_once_the_container_runs():
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.environ["DOCKER_HOST"] = f"unix://{tmp_path}/gone.sock"

    thief = threading.Thread(target=lose_the_daemon_once_the_container_runs)
    thief.start()
    try:
        with pytest.raises(ModelRunError, match="gone.sock"):
            run_model_container(run)
    finally:
        thief.join()
        os.environ["DOCKER_HOST"] = docker_host.host
        docker_host.docker("rm", "-f", run.container, check=False)

    steps = read_json(Path(run.node_dir) / "status.json")["steps"]
    assert steps["container_start"]["end"] <= steps["run"]["start"] <= steps["run"]["end"]


def test_an_unusable_results_dir_fails_the_call(make_run, tmp_path):
    (tmp_path / "not-a-dir").write_text("")

    with pytest.raises(ModelRunError, match="results dir .* is not usable"):
        run_model_container(make_run("perf.sh", results_dir=str(tmp_path / "not-a-dir")))


def test_a_script_outside_the_model_dir_is_refused(make_run):
    with pytest.raises(ModelRunError, match="leaves the model dir"):
        run_model_container(make_run("../../etc/passwd"))


def test_a_docker_env_var_cannot_override_the_multi_node_topology(make_run):
    outcome = run_model_container(make_run("perf.sh", rank=1, nnodes=2, docker_env_vars={"NODE_RANK": "7"}))

    assert "NODE_RANK=1 NNODES=2" in Path(outcome.log_path).read_text()


def _all_command_lines():
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return lines


def test_a_secret_reaches_the_container_and_nothing_else(make_run, model_dir, tmp_path):
    token = f"hf_{uuid.uuid4().hex}"
    (model_dir / "secret.sh").write_text(
        'echo "token=$MAD_SECRETS_HFTOKEN"\nprintf %s "$HF_TOKEN" | md5sum\nsleep 1\nexit 1\n'
    )
    run = make_run(
        "secret.sh",
        secrets_file=secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={token}\n"),
        docker_env_vars={"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"},
    )
    seen_in_argv = []
    done = threading.Event()

    def watch_command_lines():
        while not done.is_set():
            seen_in_argv.extend(line for line in _all_command_lines() if token in line)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_command_lines)
    watcher.start()
    try:
        outcome = run_model_container(run)
    finally:
        done.set()
        watcher.join()

    log = Path(outcome.log_path).read_text()
    assert hashlib.md5(token.encode()).hexdigest() in log  # the container got the real value
    assert "token=********" in log
    for path in (outcome.log_path, outcome.status_path, outcome.diagnostics_path):
        assert token not in Path(path).read_text()
    assert token not in repr(outcome)
    assert seen_in_argv == []


def test_run_log_opens_with_the_command_the_container_got_its_variables_valued_and_secrets_masked(
    make_run, model_dir, tmp_path
):
    token = f"hf_{uuid.uuid4().hex}"
    run = make_run(
        "perf.sh",
        secrets_file=secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={token}\n"),
        docker_env_vars={"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}", "NCCL_DEBUG": "INFO"},
    )
    planned = plan_model_run(run)

    outcome = run_model_container(run)

    log = Path(outcome.log_path).read_text()
    recorded = recorded_argv(log)
    assert recorded[:3] == ["docker", "run", "-d"] and "--ipc=host" in recorded
    assert argv_matches(planned["docker_run_argv"], recorded), (planned["docker_run_argv"], recorded)
    head = log.splitlines()[: len(planned["command_lines"])]
    assert head[1:] == [
        ENV_FILE_PREFIX + "HF_TOKEN=********",
        ENV_FILE_PREFIX + "MAD_SECRETS_HFTOKEN=********",
        ENV_FILE_PREFIX + "NCCL_DEBUG=INFO",
    ]
    assert head[0].startswith(COMMAND_PREFIX) and token not in log
    assert "performance:" in log  # the container's own lines follow


def test_the_env_file_is_gone_after_the_run(make_run, tmp_path):
    before = set(Path("/dev/shm").glob("slurm-multi-env-*"))

    run_model_container(make_run("perf.sh", secrets_file=secrets_file(tmp_path, "MAD_SECRETS_A=12345678\n")))

    assert set(Path("/dev/shm").glob("slurm-multi-env-*")) == before


def test_a_short_secret_in_the_secrets_file_stops_the_run_before_anything_starts(make_run, tmp_path):
    run = make_run("perf.sh", secrets_file=secrets_file(tmp_path, "MAD_SECRETS_PIN=4242\n"))

    with pytest.raises(ModelRunError, match=r"MAD_SECRETS_PIN is 4 character\(s\) long, shorter than 8"):
        run_model_container(run)
    assert "4242" not in read_json(os.path.join(run.node_dir, "status.json"))["reason"]


PERF_WITH_ENV = (
    'echo "OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG token=$MAD_SECRETS_HFTOKEN"\n'
    "echo 'performance: 4200 tok/s'\n"
)


def test_ordinary_env_values_are_data_the_log_keeps_them_and_the_perf_line(make_run, model_dir, tmp_path):
    # The bug: every value of the environment was masked, so "4" of OMP_NUM_THREADS=4 shredded the perf line.
    (model_dir / "perf_env.sh").write_text(PERF_WITH_ENV)
    token = f"hf_{uuid.uuid4().hex}"
    run = make_run(
        "perf_env.sh",
        docker_env_vars={"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"},
        secrets_file=secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={token}\n"),
    )

    outcome = run_model_container(run)

    log = Path(outcome.log_path).read_text()
    assert "OMP_NUM_THREADS=4 NCCL_DEBUG=INFO token=********" in log
    assert "performance: 4200 tok/s" in log and token not in log
    status = read_json(outcome.status_path)
    assert (status["status"], status["perf_lines"]) == (SUCCESS, 1)


def test_ordinary_env_values_stay_in_the_reason_and_the_diagnostics(make_run, model_dir):
    (model_dir / "exit4.sh").write_text("echo 'step 4 of 4 failed'\nexit 4\n")

    outcome = run_model_container(make_run("exit4.sh", docker_env_vars={"OMP_NUM_THREADS": "4"}))

    assert read_json(outcome.status_path)["reason"] == "the container exited with code 4"
    diagnostics = Path(outcome.diagnostics_path).read_text()
    assert "ExitCode: 4" in diagnostics and "step 4 of 4 failed" in diagnostics


def test_a_log_file_gone_between_two_looks_has_no_signature(tmp_path):
    # The run's log watch stats each file; one removed meanwhile (a container's log rotated away) is no error.
    log = tmp_path / "run.log"
    log.write_text("x")
    assert _file_signature(str(log))[1] == 1
    log.unlink()
    assert _file_signature(str(log)) is None


def _at_barrier(run, image_id, timeout=30.0):
    """The barrier a node's run meets before its container (the run module's `barrier` option), on loopback."""
    node = NodeAtBarrier(
        rank=run.rank,
        nnodes=run.nnodes,
        master_addr="127.0.0.1",
        master_port=run.master_port,
        job_id=run.job_id,
        token="test-barrier-token",
        image_id=image_id,
        hosts=[f"node{rank}" for rank in range(run.nnodes)],
        timeout=timeout,
        port_range="26000-26999",
        job_dir=run.attempt_dir,
    )
    return lambda: meet_every_node(node, logging.getLogger("test.barrier"))


def test_every_rank_meets_the_others_at_the_barrier_before_its_container_starts(make_run, busybox_image):
    runs = [make_run("perf.sh", rank=rank, nnodes=2) for rank in (0, 1)]
    outcomes = {}

    def run_rank(run):
        outcomes[run.rank] = run_model_container(run, meet_other_nodes=_at_barrier(run, busybox_image[1]))

    threads = [threading.Thread(target=run_rank, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    for rank in (0, 1):
        status = outcomes[rank].status
        assert status["status"] == SUCCESS, status
        assert status["steps"]["barrier"]["end"] <= status["steps"]["container_start"]["start"], status["steps"]
        assert outcomes[rank].barrier["port"] in range(26000, 27000)
    assert [worker["rank"] for worker in outcomes[0].barrier["workers"]] == [1]


def test_a_barrier_that_ends_without_go_starts_no_container_and_fails_the_task(make_run, busybox_image):
    # Rank 0 alone: its worker never comes. The task fails with the barrier's reason; the rescue records the node.
    # (The job_id fixture fails the test if a container of the job is left.)
    run = make_run("perf.sh", rank=0, nnodes=2)
    with pytest.raises(BarrierFailed) as failure:
        run_model_container(run, meet_other_nodes=_at_barrier(run, busybox_image[1], timeout=1))
    assert failure.value.fields["missing"] == [{"rank": 1, "host": "node1"}]
    assert not Path(run.node_dir, "status.json").exists()
