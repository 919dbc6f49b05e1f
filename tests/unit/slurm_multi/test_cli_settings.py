"""`slurm-multi submit` and `run` reach every setting: -e, the user's and the site's settings files, the settings'
environment variables, and a flag beside -e (docs/settings.md). Dry runs show what the job would get."""

import json

import pytest

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTINGS
from tests.unit.slurm_multi.test_cli_submit import _config_of, _dry_run, _tree, _vars_of, cli  # noqa: F401 - the fixture


@pytest.fixture
def settings_files(tmp_path_factory, monkeypatch):
    """(site file, user file), both empty yet (the variables naming them must name files that exist), outside the
    command's HOME (which stays empty)."""
    folder = tmp_path_factory.mktemp("settings")
    monkeypatch.delenv("MAD_DOCKER_BUILDS", raising=False)
    (folder / "site.yml").touch()
    (folder / "settings.yml").touch()
    return folder / "site.yml", folder / "settings.yml"


def _env(settings_files, **extra):
    site, user = settings_files
    return {"SLURM_MULTI_SITE_CONFIG": str(site), "SLURM_MULTI_SETTINGS": str(user), **extra}


def test_e_puts_a_setting_in_the_jobs_vars_as_a_number(cli, settings_files):  # noqa: F811
    job_vars = _vars_of(_dry_run(cli, "-e", "barrier_timeout=42", env=_env(settings_files)))
    assert job_vars["barrier_timeout"] == 42


def test_e_forms_combine_and_the_later_wins(cli, settings_files, tmp_path):  # noqa: F811
    (tmp_path / "vars.yml").write_text("heartbeat_stale: 90\nimage_cache_keep: 2\n")
    output = _dry_run(
        cli,
        *("-e", f"@{tmp_path / 'vars.yml'}", "-e", '{"image_cache_keep": 3}', "-e", "rebuild_fallback=true"),
        env=_env(settings_files),
    )
    job_vars = _vars_of(output)
    assert (job_vars["heartbeat_stale"], job_vars["image_cache_keep"], job_vars["rebuild_fallback"]) == (90, 3, True)


def test_run_takes_e_too(cli, settings_files):  # noqa: F811
    result = cli(["run", "--tags", "dummy", "-e", "barrier_timout=1"], env=_env(settings_files))
    assert result.returncode == 2 and "-e barrier_timout=1: unknown setting" in result.stderr


def test_an_unknown_setting_is_refused_naming_the_e_and_the_closest_before_anything_is_written(
    cli,  # noqa: F811
    settings_files,
    tmp_path,
):
    result = cli(["submit", "-N", "2", "--tags", "dummy", "-e", "heartbeat_stal=5"], env=_env(settings_files))
    assert result.returncode == 2
    assert "-e heartbeat_stal=5: unknown setting 'heartbeat_stal' (did you mean heartbeat_stale?)" in result.stderr
    assert _tree(tmp_path) == []


def test_a_word_without_equals_is_refused_with_the_forms(cli, settings_files, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "-e", "barrier_timeout"], env=_env(settings_files))
    assert result.returncode == 2 and "the forms accepted: KEY=VALUE" in result.stderr
    assert _tree(tmp_path) == []


def test_a_flag_and_e_disagreeing_are_refused_naming_both(cli, settings_files, tmp_path):  # noqa: F811
    result = cli(
        ["submit", "-N", "2", "--tags", "dummy", "--registry", "docker.io/a/b", "-e", "registry=docker.io/c/d"],
        env=_env(settings_files),
    )
    assert result.returncode == 2
    assert "--registry docker.io/a/b and -e registry=docker.io/c/d disagree" in result.stderr
    assert _tree(tmp_path) == []


def test_a_flag_and_e_agreeing_are_one_setting(cli, settings_files, tmp_path):  # noqa: F811
    output = _dry_run(
        cli, "--results-dir", "res", "-e", f"results_dir={tmp_path / 'res'}", "--mode", "pull", "-e", "mode=pull",
        env=_env(settings_files),
    )  # fmt: skip
    assert (_vars_of(output)["results_dir"], _vars_of(output)["mode"]) == (str(tmp_path / "res"), "pull")


def test_e_alone_does_what_its_flag_does(cli, settings_files):  # noqa: F811
    job_vars = _vars_of(_dry_run(cli, "-e", "registry=rocm/pytorch-private", env=_env(settings_files)))
    assert job_vars["registry"] == "docker.io/rocm/pytorch-private"  # normalized, as --registry's


def test_e_image_cache_dir_that_the_nodes_environment_overrides_is_refused(cli, settings_files):  # noqa: F811
    result = cli(
        ["submit", "--dry-run", "-N", "2", "--tags", "dummy", "-e", "image_cache_dir=/shared/a"],
        env=_env(settings_files, MAD_DOCKER_BUILDS="/shared/b"),
    )
    assert result.returncode == 2
    assert "-e image_cache_dir=/shared/a and MAD_DOCKER_BUILDS=/shared/b disagree" in result.stderr


def test_the_user_files_results_dir_and_mode_are_the_jobs(cli, settings_files):  # noqa: F811
    _, user = settings_files
    user.write_text("results_dir: /shared/mine\nmode: pull\n")
    job_vars = _vars_of(_dry_run(cli, env=_env(settings_files)))
    assert (job_vars["results_dir"], job_vars["mode"]) == ("/shared/mine", "pull")


def test_the_environment_wins_over_the_user_file_and_a_flag_over_the_environment(cli, settings_files):  # noqa: F811
    _, user = settings_files
    user.write_text("results_dir: /shared/mine\nmode: pull\n")
    env = _env(settings_files, SLURM_MULTI_RESULTS_DIR="/shared/env", SLURM_MULTI_MODE="push")
    job_vars = _vars_of(_dry_run(cli, env=env))
    assert (job_vars["results_dir"], job_vars["mode"]) == ("/shared/env", "push")
    assert _vars_of(_dry_run(cli, "--results-dir", "/shared/flag", env=env))["results_dir"] == "/shared/flag"


def test_the_user_file_wins_over_the_site_file(cli, settings_files):  # noqa: F811
    site, user = settings_files
    site.write_text("settings:\n  results_dir: /shared/site\n  models_file: /nonexistent/models.json\n")
    user.write_text("results_dir: /shared/mine\n")
    result = cli(["submit", "--dry-run", "-N", "2", "--tags", "dummy"], env=_env(settings_files))
    assert result.returncode == 2 and "the models file /nonexistent/models.json does not exist" in result.stderr
    site.write_text("settings:\n  results_dir: /shared/site\n")
    assert _vars_of(_dry_run(cli, env=_env(settings_files)))["results_dir"] == "/shared/mine"


def test_the_dry_run_shows_the_settings_every_node_gets_from_the_files(cli, settings_files):  # noqa: F811
    site, _ = settings_files
    site.write_text("settings:\n  barrier_timeout: 900\n")
    output = _dry_run(cli, env=_env(settings_files))
    assert f"# ---- the settings of {site}, " in output
    assert json.loads(output.split("the job's vars above win) ----\n", 1)[1].split("\n# ")[0]) == {
        "barrier_timeout": 900
    }
    assert "barrier_timeout" not in _vars_of(output)  # the job's vars hold what the job itself chose


def test_the_sites_registry_is_the_jobs_unless_the_job_chooses_another_transport(cli, settings_files):  # noqa: F811
    site, _ = settings_files
    site.write_text("settings:\n  registry: docker.io/site/bench\n")
    assert _vars_of(_dry_run(cli, env=_env(settings_files)))["registry"] == "docker.io/site/bench"
    job_vars = _vars_of(_dry_run(cli, "--image-transport", "cache", env=_env(settings_files)))
    # Written empty: the inventory gives every node the site's registry, which would otherwise win the transport.
    assert (job_vars["registry"], job_vars["image_transport"]) == ("", "cache")


def test_the_files_additional_context_lies_under_the_jobs_config(cli, settings_files):  # noqa: F811
    _, user = settings_files
    user.write_text("additional_context:\n  docker_env_vars: {A: '1', B: '2'}\n")
    output = _dry_run(cli, "-c", '{"docker_env_vars": {"B": "3"}}', env=_env(settings_files))
    assert _config_of(output)["docker_env_vars"] == {"A": "1", "B": "3"}


def test_a_malformed_user_file_is_refused_naming_it_and_its_line_before_anything_is_written(
    cli,  # noqa: F811
    settings_files,
    tmp_path,
):
    _, user = settings_files
    user.write_text("barrier_timeout: 900\nheartbeat_stale: {\n")
    result = cli(["submit", "-N", "2", "--tags", "dummy"], env=_env(settings_files))
    assert result.returncode == 2 and f"{user}: not valid YAML: line 3" in result.stderr
    assert _tree(tmp_path) == []


def test_report_and_logs_default_to_the_user_files_results_dir(settings_files, monkeypatch):
    _, user = settings_files
    user.write_text("results_dir: /shared/mine\n")
    for name, value in _env(settings_files).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_MULTI_RESULTS_DIR", raising=False)
    assert str(slurm_multi.default_results_dir()) == "/shared/mine"


def test_settings_shows_each_settings_value_and_where_it_comes_from(cli, settings_files, tmp_path):  # noqa: F811
    site, user = settings_files
    site.write_text("settings:\n  image_cache_keep: 9\n  heartbeat_stale: 60\n")
    user.write_text("heartbeat_stale: 45\n")
    env = _env(settings_files, SLURM_MULTI_RESULTS_DIR=str(tmp_path / "r"))
    result = cli(["settings", "-e", "barrier_timeout=900"], env=env)
    assert result.returncode == 0, result.stderr
    shown = {line.split()[0]: line.split(None, 1)[1] for line in result.stdout.splitlines()}
    assert shown["image_cache_keep"] == f"9  ({site})"
    assert shown["heartbeat_stale"] == f"45  ({user})"
    assert shown["barrier_timeout"] == "900  (-e)"
    assert shown["results_dir"] == f'"{tmp_path / "r"}"  ($SLURM_MULTI_RESULTS_DIR)'
    assert shown["image_cache_dir"] == f'"{tmp_path / "r" / "image-cache-%u"}"  (default)'
    assert shown["preflight_max_clock_skew"] == "10.0  (default)"
    assert list(shown) == list(SETTINGS)
