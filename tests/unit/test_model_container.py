"""The run logic of one node's model container, against a real (private) Docker daemon.

Models are tiny shell scripts in a temp model dir, run in a 2 MB busybox image. Several ranks of one job are
several concurrent calls of the run logic (threads) against the same daemon.
"""

import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from ansible.module_utils.model_container import (
    FAILURE,
    SUCCESS,
    Cancellation,
    ModelRun,
    ModelRunError,
    container_environment,
    container_name,
    model_command,
    plan_model_run,
    read_abort_marker,
    run_model_container,
    write_abort_marker,
)
from ansible.module_utils.secrets_env import SecretsError
from tests.support.dockerd import job_leaving_no_containers

MODELS = {
    "perf.sh": (
        'echo "NODE_RANK=$NODE_RANK NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"\n'
        'for arg in "$@"; do echo "arg<$arg>"; done\n'
        "echo 'performance: 42 samples_per_second'\n"
    ),
    "crash.sh": "echo 'starting'\necho 'RuntimeError: NCCL communicator broke'\nexit 3\n",
    "pattern_only.sh": "echo 'Traceback (most recent call last)'\necho 'performance: 1 x'\nexit 0\n",
    "hang.sh": "echo 'waiting in allreduce'\nsleep 1000\n",
    "fail_later.sh": "sleep 1\necho 'rank lost its GPU'\nexit 1\n",
    "csv.sh": (
        "printf 'model,performance,metric\\ndummy,42,samples_per_second\\n' > perf_dummy.csv\n"
        "echo 'performance: 42 samples_per_second'\n"
    ),
    "list_data.sh": "ls /data\n",
}


@pytest.fixture
def docker_host(private_dockerd, monkeypatch):
    """Point every docker CLI call of the code under test at the private daemon."""
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    return private_dockerd


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for name, text in MODELS.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture
def job_id(docker_host):
    """A fresh job ID; afterwards no container of that job may be left on the daemon."""
    with job_leaving_no_containers(docker_host, "t") as job:
        yield job


@pytest.fixture
def make_run(busybox_image, model_dir, tmp_path, job_id):
    def make(script, rank=0, nnodes=1, **overrides):
        options = dict(
            job_id=job_id, rank=rank, nnodes=nnodes, node=f"node{rank}", model="dummy", image=busybox_image[0],
            model_dir=str(model_dir), script=script, results_dir=str(tmp_path / "results"),
            master_addr="127.0.0.1", master_port=29500, user="tester", poll_interval=0.2, stop_grace=1,
            diagnostics_budget=10,
        )
        options.update(overrides)
        return ModelRun(**options)

    return make


def _read_json(path):
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------------------------- success


def test_a_successful_model_gets_a_success_status_with_its_perf_lines(make_run):
    outcome = run_model_container(make_run("perf.sh"))

    status = _read_json(outcome.status_path)
    assert status["status"] == SUCCESS
    assert status["exit_code"] == 0 and status["perf_lines"] == 1 and status["reason"] == ""
    assert outcome.started and outcome.diagnostics_path is None


def test_the_status_file_follows_the_contract_schema(make_run, job_id):
    outcome = run_model_container(make_run("perf.sh", rank=1, nnodes=2))

    status = _read_json(outcome.status_path)
    assert set(status) == {
        "node", "rank", "nnodes", "job_id", "model", "status", "exit_code", "error_pattern", "aborted_by_rank",
        "cancelled", "timed_out", "perf_lines", "reason", "started_at", "ended_at",
    }
    assert (status["node"], status["rank"], status["nnodes"], status["job_id"]) == ("node1", 1, 2, job_id)
    assert status["ended_at"] >= status["started_at"]


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


def test_the_model_command_runs_a_shell_script_with_sh_and_split_args():
    assert model_command("scripts/run.sh", "--epochs 2 --name 'a b'") == [
        "sh", "scripts/run.sh", "--epochs", "2", "--name", "a b",
    ]


def test_the_model_command_runs_another_script_directly_with_list_args():
    assert model_command("train.py", ["--lr", "$(x)"]) == ["./train.py", "--lr", "$(x)"]


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


def test_a_results_csv_left_over_from_an_earlier_run_is_not_copied(make_run, model_dir):
    (model_dir / "old.csv").write_text("model,performance,metric\nold,1,x\n")

    outcome = run_model_container(make_run("perf.sh", multiple_results="old.csv"))

    assert outcome.results_csv is None
    assert not (Path(outcome.status_path).parent / "old.csv").exists()


# ---------------------------------------------------------------------------------------------------- failures


def test_a_crashing_model_is_a_failure_status_not_an_error(make_run):
    outcome = run_model_container(make_run("crash.sh"))

    status = _read_json(outcome.status_path)
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

    status = _read_json(outcome.status_path)
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


# ---------------------------------------------------------------------------------------------------- infrastructure


def test_a_missing_image_fails_the_call_and_tells_the_other_ranks(make_run, tmp_path, job_id):
    with pytest.raises(ModelRunError, match="image slurm-multi-test/absent:1 is not on node0"):
        run_model_container(make_run("perf.sh", nnodes=2, image="slurm-multi-test/absent:1"))

    status = _read_json(tmp_path / "results" / job_id / "attempt-0" / "nodes" / "node0" / "status.json")
    assert status["status"] == FAILURE and status["exit_code"] is None
    assert read_abort_marker(str(tmp_path / "results" / job_id / "attempt-0"))["rank"] == 0


def test_an_unreachable_docker_daemon_fails_the_call(make_run, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")

    with pytest.raises(ModelRunError, match="no-daemon.sock"):
        run_model_container(make_run("perf.sh"))


def test_an_unusable_results_dir_fails_the_call(make_run, tmp_path):
    (tmp_path / "not-a-dir").write_text("")

    with pytest.raises(ModelRunError, match="results dir .* is not usable"):
        run_model_container(make_run("perf.sh", results_dir=str(tmp_path / "not-a-dir")))


def test_a_script_outside_the_model_dir_is_refused(make_run):
    with pytest.raises(ModelRunError, match="leaves the model dir"):
        run_model_container(make_run("../../etc/passwd"))


def test_rm_in_the_additional_options_is_refused(make_run):
    with pytest.raises(ModelRunError, match="--rm"):
        plan_model_run(make_run("perf.sh", additional_docker_run_options="--ipc=host --rm"))


def test_model_args_with_an_unbalanced_quote_are_refused_before_anything_starts(make_run):
    with pytest.raises(ModelRunError, match="model_args .* cannot be split"):
        plan_model_run(make_run("perf.sh", model_args="--name 'unfinished"))


def test_a_docker_env_var_cannot_override_the_multi_node_topology(make_run):
    outcome = run_model_container(make_run("perf.sh", rank=1, nnodes=2, docker_env_vars={"NODE_RANK": "7"}))

    assert "NODE_RANK=1 NNODES=2" in Path(outcome.log_path).read_text()


def test_a_job_id_that_cannot_name_a_container_is_refused(make_run):
    with pytest.raises(ModelRunError, match="job_id '../x'"):
        plan_model_run(make_run("perf.sh", job_id="../x"))


# ---------------------------------------------------------------------------------------------------- plan


def test_the_plan_names_the_container_labels_network_and_command(make_run, job_id):
    argv = plan_model_run(make_run("perf.sh", rank=1, nnodes=2, model_args="--x 1"))["docker_run_argv"]

    assert argv[:6] == ["docker", "run", "-d", "--init", "--name", container_name(job_id, 1)]
    for label in (f"slurm-multi.job={job_id}", "slurm-multi.rank=1", "slurm-multi.user=tester",
                  "slurm-multi.model=dummy"):
        assert argv[argv.index(label) - 1] == "--label"
    assert "--network=host" in argv and "--rm" not in argv
    assert argv[-4:] == ["sh", "perf.sh", "--x", "1"]


def test_the_plan_starts_no_container(make_run, docker_host, job_id):
    plan_model_run(make_run("perf.sh"))

    assert docker_host.docker("ps", "-a", "-q", "--filter", f"label=slurm-multi.job={job_id}").stdout == ""


# ---------------------------------------------------------------------------------------------------- secrets


def _secrets_file(tmp_path, text):
    path = tmp_path / "secrets.env"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


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
        'echo "token=$MAD_SECRETS_HFTOKEN"\n'
        'printf %s "$HF_TOKEN" | md5sum\n'
        "sleep 1\n"
        "exit 1\n"
    )
    run = make_run(
        "secret.sh", secrets_file=_secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={token}\n"),
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


def test_the_env_file_is_gone_after_the_run(make_run, tmp_path):
    before = set(Path("/dev/shm").glob("slurm-multi-env-*"))

    run_model_container(make_run("perf.sh", secrets_file=_secrets_file(tmp_path, "MAD_SECRETS_A=12345678\n")))

    assert set(Path("/dev/shm").glob("slurm-multi-env-*")) == before


def test_a_secret_placeholder_gets_the_secret_value():
    environment = container_environment({"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"}, {"MAD_SECRETS_HFTOKEN": "hf_value"})

    assert environment.variables == {"HF_TOKEN": "hf_value", "MAD_SECRETS_HFTOKEN": "hf_value"}
    assert environment.warnings == []


def test_a_placeholder_without_a_value_is_dropped_with_a_warning():
    environment = container_environment({"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}", "A": "1"}, {})

    assert environment.variables == {"A": "1"}
    assert "HF_TOKEN left unset" in environment.warnings[0] and "${MAD_SECRETS_HFTOKEN}" in environment.warnings[0]


def test_a_secret_wins_over_a_stale_manifest_value_of_the_same_name():
    environment = container_environment({"MAD_SECRETS_HFTOKEN": "stale-value"}, {"MAD_SECRETS_HFTOKEN": "fresh-value"})

    assert environment.variables["MAD_SECRETS_HFTOKEN"] == "fresh-value"
    assert "stale-value" not in environment.secret_values


def test_only_secret_values_are_marked_for_masking():
    environment = container_environment(
        {"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO", "AUTH": "Bearer ${MAD_SECRETS_HFTOKEN}",
         "MAD_SECRETS_LEGACY": "legacy-literal"},
        {"MAD_SECRETS_HFTOKEN": "hf_value"},
    )

    assert environment.variables["OMP_NUM_THREADS"] == "4" and environment.variables["AUTH"] == "Bearer hf_value"
    assert sorted(environment.secret_values) == ["Bearer hf_value", "hf_value", "legacy-literal"]


def test_a_short_secret_is_refused_naming_it_never_showing_it():
    with pytest.raises(SecretsError, match="MAD_SECRETS_PIN is 4 character") as raised:
        container_environment({}, {"MAD_SECRETS_PIN": "4242"})
    assert "4242" not in str(raised.value)
    with pytest.raises(SecretsError, match="docker_env_vars: the secret MAD_SECRETS_LEGACY is 3 character"):
        container_environment({"MAD_SECRETS_LEGACY": "abc"}, {})


def test_a_short_secret_in_the_secrets_file_stops_the_run_before_anything_starts(make_run, tmp_path):
    run = make_run("perf.sh", secrets_file=_secrets_file(tmp_path, "MAD_SECRETS_PIN=4242\n"))

    with pytest.raises(ModelRunError, match=r"MAD_SECRETS_PIN is 4 character\(s\) long, shorter than 8"):
        run_model_container(run)
    assert "4242" not in _read_json(os.path.join(run.node_dir, "status.json"))["reason"]


PERF_WITH_ENV = (
    'echo "OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG token=$MAD_SECRETS_HFTOKEN"\n'
    "echo 'performance: 4200 tok/s'\n"
)


def test_ordinary_env_values_are_data_the_log_keeps_them_and_the_perf_line(make_run, model_dir, tmp_path):
    # The bug: every value of the environment was masked, so "4" of OMP_NUM_THREADS=4 shredded the perf line.
    (model_dir / "perf_env.sh").write_text(PERF_WITH_ENV)
    token = f"hf_{uuid.uuid4().hex}"
    run = make_run("perf_env.sh", docker_env_vars={"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"},
                   secrets_file=_secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={token}\n"))

    outcome = run_model_container(run)

    log = Path(outcome.log_path).read_text()
    assert "OMP_NUM_THREADS=4 NCCL_DEBUG=INFO token=********" in log
    assert "performance: 4200 tok/s" in log and token not in log
    status = _read_json(outcome.status_path)
    assert (status["status"], status["perf_lines"]) == (SUCCESS, 1)


def test_ordinary_env_values_stay_in_the_reason_and_the_diagnostics(make_run, model_dir):
    (model_dir / "exit4.sh").write_text("echo 'step 4 of 4 failed'\nexit 4\n")

    outcome = run_model_container(make_run("exit4.sh", docker_env_vars={"OMP_NUM_THREADS": "4"}))

    assert _read_json(outcome.status_path)["reason"] == "the container exited with code 4"
    diagnostics = Path(outcome.diagnostics_path).read_text()
    assert "ExitCode: 4" in diagnostics and "step 4 of 4 failed" in diagnostics


def test_the_planned_argv_keeps_ordinary_values_and_masks_secret_ones(make_run, tmp_path):
    plan = plan_model_run(make_run(
        "perf.sh", docker_env_vars={"OMP_NUM_THREADS": "4", "AUTH": "Bearer ${MAD_SECRETS_HFTOKEN}"},
        additional_docker_run_options="--shm-size=4g --label note=s3cr3t-value",
        secrets_file=_secrets_file(tmp_path, "MAD_SECRETS_HFTOKEN=s3cr3t-value\n")))

    assert "--shm-size=4g" in plan["docker_run_argv"]
    assert "note=********" in plan["docker_run_argv"]


def test_a_docker_env_var_an_env_file_cannot_carry_is_refused_before_anything_starts(make_run):
    with pytest.raises(ModelRunError, match="'BAD-NAME' is not a valid environment variable name"):
        plan_model_run(make_run("perf.sh", docker_env_vars={"BAD-NAME": "1"}))


def test_the_plan_shows_variable_names_but_no_secret_value(make_run, tmp_path):
    plan = plan_model_run(make_run("perf.sh", secrets_file=_secrets_file(tmp_path, "MAD_SECRETS_K=s3cr3t-value\n")))

    assert plan["env_file_variables"] == ["MAD_SECRETS_K"]
    assert "--env-file" in plan["docker_run_argv"]
    assert "s3cr3t-value" not in json.dumps(plan)
