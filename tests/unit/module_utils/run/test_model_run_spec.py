"""A node's run plan: the model command, the docker argv and the container environment, decided before any start."""

import json

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SecretsError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run import model_run_spec
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRunError,
    container_environment,
    container_name,
    model_command,
    plan_model_run,
)
from tests.support.lab.model_runs import secrets_file

# The fixtures docker_host, model_dir, job_id and make_run.
pytest_plugins = ("tests.support.lab.model_run_fixtures",)


def test_the_model_command_runs_a_shell_script_with_bash_else_sh_and_split_args():
    # How the shell is chosen, really run: test_model_script_shell.py.
    command = model_command("scripts/run.sh", "--epochs 2 --name 'a b'", image="img")
    assert command[:2] == ["sh", "-c"] and 'exec bash "$@"' in command[2]
    assert command[3:] == ["img", "scripts/run.sh", "--epochs", "2", "--name", "a b"]


def test_the_model_command_runs_a_python_script_with_python3_as_madengine_does_and_another_directly():
    # madengine (execution/container_runner.py): "python3 " + the script's name for a .py script.
    assert model_command("train.py", ["--lr", "$(x)"]) == ["python3", "train.py", "--lr", "$(x)"]
    assert model_command("launch", ["--lr", "$(x)"]) == ["./launch", "--lr", "$(x)"]
    assert model_command("job.slurm", "a")[:2] == ["sh", "-c"]


def test_rm_in_the_additional_options_is_refused(make_run):
    with pytest.raises(ModelRunError, match="--rm"):
        plan_model_run(make_run("perf.sh", additional_docker_run_options="--ipc=host --rm"))


def test_model_args_with_an_unbalanced_quote_are_refused_before_anything_starts(make_run):
    with pytest.raises(ModelRunError, match="model_args .* cannot be split"):
        plan_model_run(make_run("perf.sh", model_args="--name 'unfinished"))


def test_a_job_id_that_cannot_name_a_container_is_refused(make_run):
    with pytest.raises(ModelRunError, match="job_id '../x'"):
        plan_model_run(make_run("perf.sh", job_id="../x"))


def test_a_heterogeneous_job_id_is_refused_because_docker_cannot_name_its_container(make_run):
    with pytest.raises(ModelRunError, match=r"job_id '4242\+0' cannot name a container"):
        plan_model_run(make_run("perf.sh", job_id="4242+0"))


def test_a_node_name_that_cannot_name_its_results_dir_is_refused_before_anything_starts(make_run):
    with pytest.raises(ModelRunError, match="node name 'node 1' cannot name a results directory"):
        plan_model_run(make_run("perf.sh", node="node 1"))


def test_an_attempt_that_is_not_a_requeue_count_is_refused_with_what_to_give(make_run):
    with pytest.raises(ModelRunError, match="attempt -1 is not an attempt number: use 0 for a job's first run"):
        plan_model_run(make_run("perf.sh", attempt=-1))


def test_the_plan_names_the_container_labels_network_and_command(make_run, job_id):
    argv = plan_model_run(make_run("perf.sh", rank=1, nnodes=2, model_args="--x 1"))["docker_run_argv"]

    assert argv[:6] == ["docker", "run", "-d", "--init", "--name", container_name(job_id, 1)]
    for label in (
        f"slurm-multi.job={job_id}",
        "slurm-multi.rank=1",
        "slurm-multi.user=tester",
        "slurm-multi.model=dummy",
    ):
        assert argv[argv.index(label) - 1] == "--label"
    assert "--network=host" in argv and "--rm" not in argv
    assert argv[-3:] == ["perf.sh", "--x", "1"]


def test_the_container_shares_the_hosts_ipc_as_madengine_runs_it_unless_the_user_sizes_its_shm(make_run):
    assert "--ipc=host" in plan_model_run(make_run("perf.sh"))["docker_run_argv"]
    for options in ("--shm-size=16g", "--ipc private", "--ipc=shareable"):
        argv = plan_model_run(make_run("perf.sh", additional_docker_run_options=options))["docker_run_argv"]
        assert "--ipc=host" not in argv, options


def test_a_node_with_infiniband_gives_the_container_its_devices_and_unlimited_memlock(make_run, tmp_path, monkeypatch):
    assert "--ulimit" not in plan_model_run(make_run("perf.sh"))["docker_run_argv"]  # this machine has no HCA
    monkeypatch.setattr(model_run_spec, "INFINIBAND_DEVICES", str(tmp_path))
    argv = plan_model_run(make_run("perf.sh"))["docker_run_argv"]
    assert argv[argv.index("--device") + 1] == str(tmp_path)
    assert argv[argv.index("--ulimit") + 1] == "memlock=-1:-1"
    argv = plan_model_run(make_run("perf.sh", additional_docker_run_options="--ulimit memlock=8192"))["docker_run_argv"]
    assert argv.count("--ulimit") == 1 and "memlock=8192" in argv


def test_the_plan_starts_no_container(make_run, docker_host, job_id):
    plan_model_run(make_run("perf.sh"))

    assert docker_host.docker("ps", "-a", "-q", "--filter", f"label=slurm-multi.job={job_id}").stdout == ""


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
        {
            "OMP_NUM_THREADS": "4",
            "NCCL_DEBUG": "INFO",
            "AUTH": "Bearer ${MAD_SECRETS_HFTOKEN}",
            "MAD_SECRETS_LEGACY": "legacy-literal",
        },
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


def test_the_planned_argv_keeps_ordinary_values_and_masks_secret_ones(make_run, tmp_path):
    plan = plan_model_run(
        make_run(
            "perf.sh",
            docker_env_vars={"OMP_NUM_THREADS": "4", "AUTH": "Bearer ${MAD_SECRETS_HFTOKEN}"},
            additional_docker_run_options="--shm-size=4g --label note=s3cr3t-value",
            secrets_file=secrets_file(tmp_path, "MAD_SECRETS_HFTOKEN=s3cr3t-value\n"),
        )
    )

    assert "--shm-size=4g" in plan["docker_run_argv"]
    assert "note=********" in plan["docker_run_argv"]


def test_a_docker_env_var_an_env_file_cannot_carry_is_refused_before_anything_starts(make_run):
    with pytest.raises(ModelRunError, match="'BAD-NAME' is not a valid environment variable name"):
        plan_model_run(make_run("perf.sh", docker_env_vars={"BAD-NAME": "1"}))


def test_the_plan_shows_variable_names_but_no_secret_value(make_run, tmp_path):
    plan = plan_model_run(make_run("perf.sh", secrets_file=secrets_file(tmp_path, "MAD_SECRETS_K=s3cr3t-value\n")))

    assert plan["env_file_variables"] == ["MAD_SECRETS_K"]
    assert "--env-file" in plan["docker_run_argv"]
    assert "s3cr3t-value" not in json.dumps(plan)
