"""`slurm-multi submit` and `run` input handling: refused before anything is written or submitted, dry runs.

Each test runs the command line in a fresh HOME and working directory, so "nothing written" means both stay empty.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import (
    NODE_FABRIC,
    NODE_GPU_COUNT,
    NODE_GPUS,
)
from slurm_multi.cli import main
from tests.support.container_command import recorded_argv

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """Run `slurm-multi ARGS` in this process with HOME and the working directory at tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_MULTI_RESULTS_DIR", raising=False)
    for name in [name for name in os.environ if name.startswith(("MAD_SECRETS_", "SLURM_"))]:
        monkeypatch.delenv(name)

    def run(args, env=None):
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _dry_run(cli, *args, env=None):
    result = cli(["submit", "--dry-run", "--nodes", "2", "--tags", "dummy", *args], env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _vars_of(dry_run_output):
    after_heading = dry_run_output.split("vars.json (every string marked unsafe for Ansible when written) ----\n", 1)[1]
    return json.loads(after_heading.split("\n# ", 1)[0])


@pytest.mark.parametrize("command", ["submit", "run", "collect", "report"])
def test_help_of_each_command_creates_nothing(command, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", command, "--help"],
        cwd=tmp_path,
        env=dict(os.environ, HOME=str(tmp_path)),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0
    assert _tree(tmp_path) == []


def test_help_shows_the_default_results_dir(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse would break ~/slurm-multi-results at a hyphen
    assert "~/slurm-multi-results" in " ".join(cli(["submit", "--help"]).stdout.split())


def test_a_dry_run_prints_both_scripts_and_writes_nothing(cli, tmp_path):
    output = _dry_run(cli)
    assert "#SBATCH --nodes=2" in output
    assert "#SBATCH --dependency=afterany:<job id>" in output
    assert _tree(tmp_path) == []


def test_the_dry_run_script_uses_this_checkouts_ansible_content(cli):
    assert f"export ANSIBLE_CONFIG={ROOT}/ansible.cfg" in _dry_run(cli)


def test_invalid_additional_context_json_is_refused_with_the_position(cli, tmp_path):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummy", "-c", '{"gpu_vendor": AMD}'])
    assert result.returncode == 2
    assert "line 1 column 16" in result.stderr
    assert _tree(tmp_path) == []


def test_an_additional_context_that_is_not_an_object_is_refused(cli):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummy", "-c", "[1, 2]"])
    assert result.returncode == 2
    assert "must be a JSON object" in result.stderr


@pytest.mark.parametrize("registry", ["@bad/foo", "my registry/x", "https://ghcr.io/org/repo", ""])
def test_a_malformed_registry_is_refused_with_examples_before_anything_is_written(cli, registry, tmp_path):
    result = cli(["submit", "-N", "2", "--tags", "dummy", "--registry", registry])
    assert result.returncode == 2
    assert f"invalid registry {registry!r}" in result.stderr
    assert "ghcr.io/myorg/myrepo" in result.stderr
    assert _tree(tmp_path) == []


def test_a_docker_hub_shorthand_registry_is_normalized_in_the_job_vars(cli):
    assert _vars_of(_dry_run(cli, "--registry", "rocm/pytorch-private"))["registry"] == "docker.io/rocm/pytorch-private"


def test_the_additional_context_file_and_c_are_merged_recursively(cli, tmp_path):
    context_file = tmp_path / "ctx.json"
    context_file.write_text('{"docker_env_vars": {"A": "1", "B": "2"}, "gpu_vendor": "AMD"}')
    output = _dry_run(cli, "--additional-context-file", str(context_file), "-c", '{"docker_env_vars": {"B": "3"}}')
    assert _vars_of(output)["additional_context"] == {
        "docker_env_vars": {"A": "1", "B": "3"},
        "gpu_vendor": "AMD",
        "slurm": {"nodes": 2},  # the command line's --nodes, the top layer
    }


def test_template_syntax_in_the_context_is_carried_as_given(cli):
    context = {"docker_env_vars": {"ARGS": "{{ lookup('pipe', 'id') }} $(id)"}}
    output = _dry_run(cli, "-c", json.dumps(context))
    assert _vars_of(output)["additional_context"]["docker_env_vars"] == context["docker_env_vars"]


def test_mad_slurm_section_gives_defaults_that_options_override(cli):
    context = {
        "slurm": {
            "partition": "amd-rccl",
            "nodes": 4,
            "time": "04:00:00",
            "exclusive": False,
            "output_dir": "./slurm_output",
        }
    }
    result = cli(["submit", "--dry-run", "--tags", "dummy", "-c", json.dumps(context), "--time", "30"])
    assert result.returncode == 0, result.stderr
    job_script = result.stdout.split("collect.sbatch")[0]
    for line in ("#SBATCH --nodes=4", "#SBATCH --partition=amd-rccl", "#SBATCH --time=30"):
        assert line in job_script
    assert "#SBATCH --exclusive" not in job_script


def _config_file(tmp_path, config):
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps(config))
    return path


def _job_script(dry_run_output):
    return dry_run_output.split("collect.sbatch")[0]


def _config_of(dry_run_output):
    return json.loads(dry_run_output.split("the job's config, saved as", 1)[1].split("----\n", 1)[1].split("\n# ")[0])


def test_a_config_files_slurm_section_gives_the_sbatch_options_of_the_dry_run(cli, tmp_path):
    config = {
        "_comment": "a madengine deployment config",
        "gpu_vendor": "AMD",
        "slurm": {
            "nodes": 3,
            "time": "01:30:00",
            "gpus_per_node": 8,
            "exclusive": False,
            "account": "bench",
            "node_selector": {"partition": "gpu", "reservation": "mi300x", "exclude": "node9"},
        },
    }
    result = cli(["submit", "--dry-run", "--tags", "dummy", "--config", str(_config_file(tmp_path, config))])
    assert result.returncode == 0, result.stderr
    job_script = _job_script(result.stdout)
    for line in ("--nodes=3", "--time=01:30:00", "--gpus-per-node=8", "--account=bench", "--partition=gpu",
                 "--reservation=mi300x", "--exclude=node9"):  # fmt: skip
        assert f"#SBATCH {line}\n" in job_script
    assert "#SBATCH --exclusive" not in job_script
    assert _config_of(result.stdout) == _vars_of(result.stdout)["additional_context"]
    assert _config_of(result.stdout)["slurm"]["reservation"] == "mi300x"
    assert _tree(tmp_path) == ["deployment.json"]


def test_c_and_the_options_override_the_config_leaf_by_leaf(cli, tmp_path):
    config = {"slurm": {"nodes": 3, "node_selector": {"partition": "gpu", "reservation": "old"}, "time": "60"}}
    c = {"slurm": {"node_selector": {"reservation": "new"}}}
    output = _dry_run(cli, "--config", str(_config_file(tmp_path, config)), "-c", json.dumps(c), "--time", "30")
    job_script = _job_script(output)
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --reservation=new", "#SBATCH --time=30"):
        assert line in job_script
    assert _config_of(output)["slurm"] == {"nodes": 2, "partition": "gpu", "reservation": "new", "time": "30"}


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"slrum": {"nodes": 2}}, "unknown key 'slrum' (did you mean 'slurm'?)"),
        ({"Slurm": {"nodes": 2}}, "unknown key 'Slurm' (did you mean 'slurm'?)"),
        ({"slurm": {"partiton": "gpu"}}, "unknown key 'slurm.partiton' (did you mean 'slurm.partition'?)"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "run"])
def test_an_unknown_config_key_is_refused_before_anything_is_written(cli, tmp_path, config, refusal, command):
    path = _config_file(tmp_path, config)
    result = cli([command, "--tags", "dummy", "--config", str(path)] + (["-N", "2"] if command == "submit" else []))
    assert result.returncode == 2
    assert f"slurm-multi {command}: error: --config {path}: {refusal}" in result.stderr
    assert _tree(tmp_path) == ["deployment.json"]


def test_the_node_count_is_required(cli):
    result = cli(["submit", "--dry-run", "--tags", "dummy"])
    assert result.returncode == 2
    assert "--nodes" in result.stderr


def test_tags_selecting_several_models_are_one_sweep_job(cli):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummies"])
    assert result.returncode == 0, result.stderr
    assert "-m slurm_multi.submission.sweep" in result.stdout and '"sweep_models"' in result.stdout


def test_an_unknown_tag_is_refused_with_the_known_names(cli):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "no_such_model"])
    assert result.returncode == 2
    assert "matches no model" in result.stderr and "dummy" in result.stderr


def test_a_missing_models_file_is_refused(cli, tmp_path):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummy", "--models-file", "nope.json"])
    assert result.returncode == 2
    assert f"{tmp_path}/nope.json does not exist" in result.stderr


def test_relative_paths_become_absolute_in_the_job_vars(cli, tmp_path):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "models.json").write_text((ROOT / "models" / "models.json").read_text())
    for part in ("docker", "scripts"):  # the cards' Dockerfiles and scripts, which submit checks
        (tmp_path / "zoo" / part).symlink_to(ROOT / "models" / part)
    job_vars = _vars_of(_dry_run(cli, "--models-file", "zoo/models.json", "--results-dir", "res"))
    assert job_vars["models_file"] == str(tmp_path / "zoo" / "models.json")
    assert job_vars["results_dir"] == str(tmp_path / "res")


def test_a_slurm_value_with_whitespace_is_refused(cli):
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummy", "--partition", "gpu --uid=0"])
    assert result.returncode == 2
    assert "--partition" in result.stderr and "whitespace" in result.stderr


def test_secret_names_but_never_values_appear_in_a_dry_run(cli):
    output = _dry_run(cli, env={"MAD_SECRETS_HFTOKEN": "hf_dry_run_value"})
    assert "MAD_SECRETS_HFTOKEN" in output
    assert "hf_dry_run_value" not in output
    assert _vars_of(output)["secrets_file"].endswith("/secrets.env")


def test_run_refuses_a_job_that_already_has_a_record(cli, tmp_path):
    (tmp_path / "res" / "records" / "77").mkdir(parents=True)
    (tmp_path / "res" / "records" / "77" / "attempt-0.json").write_text('{"rows": [], "status": "SUCCESS"}')
    result = cli(["run", "--tags", "dummy", "--results-dir", str(tmp_path / "res")], env={"SLURM_JOB_ID": "77"})
    assert result.returncode == 2
    assert "already has a record" in result.stderr and "--job-id 77.2" in result.stderr


def test_a_literal_secret_in_the_context_is_refused_at_submit_and_never_shown(cli, tmp_path):
    context = '{"docker_env_vars": {"OMP_NUM_THREADS": "4", "MAD_SECRETS_HFTOKEN": "hf_literal_value_in_argv"}}'
    for extra in (["--dry-run"], []):
        result = cli(["submit", *extra, "-N", "2", "--tags", "dummy", "-c", context])
        assert result.returncode == 2
        assert "docker_env_vars.MAD_SECRETS_HFTOKEN a literal value" in result.stderr
        assert "Export it instead" in result.stderr
        assert "hf_literal_value_in_argv" not in result.stdout + result.stderr
        assert _tree(tmp_path) == []


def test_a_secret_shorter_than_8_characters_is_refused_at_submit(cli, tmp_path):
    for extra in (["--dry-run"], []):
        result = cli(["submit", *extra, "-N", "2", "--tags", "dummy"], env={"MAD_SECRETS_PIN": "4242"})
        assert result.returncode == 2
        assert "MAD_SECRETS_PIN is 4 character(s) long, shorter than 8" in result.stderr
        assert "4242" not in result.stdout + result.stderr
        assert _tree(tmp_path) == []


def test_a_dry_run_prints_each_nodes_container_command_with_values_and_masked_secrets_and_queues_nothing(
    cli, tmp_path, monkeypatch
):
    calls = tmp_path / "sbatch-calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho 4242\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    secret = "hf_" + "x7" * 12
    context = {"docker_env_vars": {"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}", "NCCL_DEBUG": "INFO"}}
    output = _dry_run(
        cli,
        "--nodelist",
        "gpu[07-08]",
        "-c",
        json.dumps(context),
        env={"MAD_SECRETS_HFTOKEN": secret, "MASTER_ADDR": "10.1.2.3"},
    )

    assert secret not in output
    commands = output.split("# ---- the container's command on each node", 1)[1]
    rank0, rank1 = commands.split("# gpu07 (rank 0):\n", 1)[1].split("# gpu08 (rank 1):\n", 1)
    for rank, lines in enumerate((rank0, rank1)):
        argv = recorded_argv(lines)
        assert argv[:5] == ["docker", "run", "-d", "--init", "--name"]
        assert argv[5] == f"slurm-multi-<job-id>-r{rank}"
        for given in ("MASTER_ADDR=10.1.2.3", f"NODE_RANK={rank}", "NNODES=2", "MAD_RUNTIME_NGPUS=" + NODE_GPU_COUNT):
            assert argv[argv.index(given) - 1] == "-e"
        assert {"--network=host", "--ipc=host", NODE_GPUS, NODE_FABRIC} <= set(argv)
        assert "slurm-multi: container env file: HF_TOKEN=********" in lines
        assert "slurm-multi: container env file: NCCL_DEBUG=INFO" in lines
    assert "/<job-id>/attempt-0/nodes/gpu08/workspace:/myworkspace" in rank1
    assert not calls.exists()
