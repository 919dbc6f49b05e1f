"""What the login node can check is checked before sbatch (issue 58): each refusal exits 2 naming the fix, and
nothing is queued. A fake `sbatch` first on PATH records every call it gets; after a refusal it has none, and the
user's HOME (where submit writes the job's private dir before sbatch) is still empty. A control submission that
passes the checks does reach it, so an empty record means something."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import split_options
from slurm_multi.cli import main

FAKE_SBATCH = """#!{python}
import json, sys
with open({calls!r}, "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
sys.stderr.write("sbatch: error: this fake queues nothing\\n")
sys.exit(1)
"""
SUBMIT = ["submit", "-N", "2", "--tags", "dummy"]


@pytest.fixture
def submit(tmp_path, monkeypatch, capsys):
    """Run `slurm-multi ARGS` in this process with an empty HOME, an empty site file, the fake sbatch first on PATH;
    returns (exit code, stderr, the sbatch calls made)."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls.jsonl"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(FAKE_SBATCH.format(python=sys.executable, calls=str(calls)))
    sbatch.chmod(0o755)
    (tmp_path / "site.yml").touch()
    for name in [name for name in os.environ if name.startswith(("MAD_SECRETS_", "SLURM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_MULTI_SITE_CONFIG", str(tmp_path / "site.yml"))
    monkeypatch.delenv("MAD_DOCKER_BUILDS", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(args, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
        said = capsys.readouterr()
        made = calls.read_text().splitlines() if calls.exists() else []
        return SimpleNamespace(code=code, said=said.out + said.err, sbatch_calls=made, home=sorted(home.rglob("*")))

    return run


def _refused(result, *words):
    assert result.code == 2, result.said
    for word in words:
        assert word in result.said, result.said
    assert result.sbatch_calls == [] and result.home == [], "something was written or queued"


def test_a_submission_that_passes_the_checks_reaches_sbatch(submit, tmp_path):
    result = submit([*SUBMIT, "--results-dir", str(tmp_path / "results")])
    assert len(result.sbatch_calls) == 1, result.said  # the control: the fake sees what a refusal would not send


@pytest.mark.parametrize(
    "given, words",
    [
        ("hang_timeout=five", ["hang_timeout 'five' is not a number", "e.g. -e hang_timeout=300.0"]),
        ("barrier_port_range=80", ["barrier_port_range 80 is below 1024", "1024 or more, 65535 or less"]),
        ("barrier_port_range=[30000,20000]", ["no range [LOW, HIGH] with LOW <= HIGH"]),
        ("image_transport=tarball", ["image_transport 'tarball' is none of cache, registry"]),
        ("preflight_checks=[docker,gpu]", ["its item 'gpu' is none of docker, disk"]),
        ("image_cache_keep=-1", ["image_cache_keep -1 is below 0"]),
        ("speedup=sometimes", ["speedup 'sometimes' is not true or false"]),
        ("mode=both", ["mode 'both' is none of push, pull"]),
        ("additional_docker_run_options='--ulimit \"memlock'", ["cannot be split into arguments as a shell would"]),
    ],
)
def test_a_setting_its_row_does_not_take_is_refused_before_sbatch(submit, tmp_path, given, words):
    _refused(submit([*SUBMIT, "--results-dir", str(tmp_path / "r"), "-e", given]), f"-e {given}", *words)


def test_a_settings_files_bad_value_is_refused_naming_the_file(submit, tmp_path):
    user_file = tmp_path / "settings.yml"
    user_file.write_text("image_transport: tarball\n")
    result = submit([*SUBMIT, "--results-dir", str(tmp_path / "r")], SLURM_MULTI_SETTINGS=str(user_file))
    _refused(result, f"{user_file}: image_transport 'tarball' is none of cache, registry")


def test_a_settings_variables_bad_value_is_refused_naming_the_variable(submit, tmp_path):
    result = submit([*SUBMIT, "--results-dir", str(tmp_path / "r")], SLURM_MULTI_MODE="sideways")
    _refused(result, "$SLURM_MULTI_MODE: mode 'sideways' is none of push, pull")


def test_settings_shows_no_value_its_row_does_not_take(submit):
    result = submit(["settings", "-e", "hang_timeout=five"])
    assert result.code == 2 and "hang_timeout 'five' is not a number" in result.said, result.said


@pytest.mark.parametrize("variable", ["SLURM_MULTI_SITE_CONFIG", "SLURM_MULTI_SETTINGS"])
def test_a_settings_file_the_environment_names_must_exist(submit, tmp_path, variable):
    missing = tmp_path / "sitee.yml"
    result = submit([*SUBMIT, "--results-dir", str(tmp_path / "r")], **{variable: str(missing)})
    _refused(result, f"${variable} names {missing}, which does not exist", f"unset {variable}")


@pytest.mark.parametrize(
    "nodelist, why", [("gpu[001-", "unbalanced brackets"), ("gpu[003-001]", "start > stop"), ("a,,b", "empty name")]
)
@pytest.mark.parametrize("option", ["--nodelist", "--exclude"])
def test_a_hostlist_slurm_refuses_is_refused_before_sbatch(submit, tmp_path, option, nodelist, why):
    result = submit([*SUBMIT, "--results-dir", str(tmp_path / "r"), option, nodelist])
    _refused(result, f"{option}={nodelist!r} is not a valid hostlist", why, "gpu[001-004,010]")


def test_a_valid_hostlist_is_written_as_given(submit, tmp_path):
    result = submit([*SUBMIT, "--dry-run", "--results-dir", str(tmp_path / "r"), "--nodelist", "gpu[001-002]"])
    assert result.code == 0 and "#SBATCH --nodelist=gpu[001-002]" in result.said, result.said


def _zoo(tmp_path, dockerfile: str, scripts: str = "scripts/m") -> Path:
    zoo = tmp_path / "zoo"
    (zoo / "docker").mkdir(parents=True)
    (zoo / "docker" / "m.ubuntu.Dockerfile").write_text("FROM scratch\n")
    (zoo / "scripts" / "m").mkdir(parents=True)
    (zoo / "scripts" / "m" / "run.sh").write_text("echo 'performance: 1 x/s'\n")
    card = {"name": "m", "tags": ["t"], "dockerfile": dockerfile, "scripts": scripts, "n_gpus": "-1", "args": ""}
    (zoo / "models.json").write_text(json.dumps([card]))
    return zoo / "models.json"


def test_a_card_whose_dockerfile_prefix_matches_no_file_is_refused_before_sbatch(submit, tmp_path):
    models = _zoo(tmp_path, "docker/mm")
    result = submit(["submit", "-N", "2", "--tags", "m", "--models-file", str(models), "--results-dir", str(tmp_path)])
    _refused(result, "model 'm': no Dockerfile matches docker/mm.*Dockerfile")


def test_a_card_whose_scripts_are_missing_is_refused_before_sbatch(submit, tmp_path):
    models = _zoo(tmp_path, "docker/m", scripts="scripts/gone")
    result = submit(["submit", "-N", "2", "--tags", "m", "--models-file", str(models), "--results-dir", str(tmp_path)])
    _refused(result, "scripts", "scripts/gone do not exist")


def test_a_tag_that_selects_nothing_is_refused_before_sbatch(submit, tmp_path):
    models = _zoo(tmp_path, "docker/m")
    result = submit(
        ["submit", "-N", "2", "--tags", "nope", "--models-file", str(models), "--results-dir", str(tmp_path)]
    )
    _refused(result, "tag 'nope' matches no model", "Model names: m")


def test_a_models_file_that_is_missing_is_refused_before_sbatch(submit, tmp_path):
    result = submit([*SUBMIT, "--models-file", str(tmp_path / "models.jsn"), "--results-dir", str(tmp_path / "r")])
    _refused(result, f"the models file {tmp_path / 'models.jsn'} does not exist")


def test_run_outside_an_allocation_refuses_unless_local(submit, tmp_path):
    result = submit(["run", "--tags", "dummy", "--results-dir", str(tmp_path / "r")])
    _refused(result, "no SLURM_JOB_ID", "slurm-multi submit", "salloc", "--local")


def test_options_given_as_one_string_in_e_reach_the_job_as_the_words_a_shell_splits(submit, tmp_path):
    result = submit(
        [
            *SUBMIT,
            "--dry-run",
            "--results-dir",
            str(tmp_path / "r"),
            "-e",
            "additional_docker_run_options=--ulimit memlock=-1",
        ]
    )
    assert result.code == 0, result.said
    job_vars = result.said.split("vars.json (every string marked unsafe for Ansible when written) ----\n")[1]
    options = json.loads(job_vars.split("\n# ")[0])["additional_docker_run_options"]
    assert split_options(options) == ["--ulimit", "memlock=-1"]  # as the run module splits it for docker run


@pytest.mark.parametrize("given", [["--registry", "127.0.0.1:17500/ns"], ["--use-image", "busybox:latest"]])
def test_a_docker_only_handoff_under_charliecloud_is_refused_before_sbatch(submit, tmp_path, given):
    result = submit(
        [*SUBMIT, "--results-dir", str(tmp_path / "results"), "-e", "container_runtime=charliecloud", *given]
    )
    _refused(result, "container_runtime charliecloud", "use container_runtime docker")
