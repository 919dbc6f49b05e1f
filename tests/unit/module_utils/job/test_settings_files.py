"""The settings given outside one command (module_utils/job/settings_files.py): -e's forms, the site and user files,
their precedence, and the refusals that name where a bad setting was given."""

import json
import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import (
    SettingsError,
    parse_extra_vars,
    read_settings,
    site_config_path,
    user_settings_path,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_group, ensure_user
from tests.support.users.user_python import slurm_multi_as


@pytest.fixture
def files(tmp_path):
    """(environ, site file, user file): both files in tmp_path (empty until a test writes them), named by the
    environment as a user would."""
    site, user = tmp_path / "site.yml", tmp_path / "settings.yml"
    site.touch()
    user.touch()
    environ = {"HOME": str(tmp_path), "SLURM_MULTI_SITE_CONFIG": str(site), "SLURM_MULTI_SETTINGS": str(user)}
    return environ, site, user


# --- -e ----------------------------------------------------------------------------------------------------------


def test_a_key_value_keeps_a_number_a_number():
    assert parse_extra_vars(["barrier_timeout=42", "heartbeat_stale=2.5"]) == {
        "barrier_timeout": 42,
        "heartbeat_stale": 2.5,
    }


def test_one_e_takes_several_key_values_and_quoted_values():
    given = parse_extra_vars(["barrier_timeout=42 registry=docker.io/org/bench use_image='my image'"])
    assert given == {"barrier_timeout": 42, "registry": "docker.io/org/bench", "use_image": "my image"}


def test_a_key_value_reads_a_yaml_list_and_an_empty_value_is_the_empty_string():
    given = parse_extra_vars(["preflight_checks=[docker,disk]", "registry="])
    assert given == {"preflight_checks": ["docker", "disk"], "registry": ""}


def test_a_json_or_yaml_mapping_is_one_e():
    assert parse_extra_vars(['{"barrier_timeout": 900, "rebuild_fallback": true}']) == {
        "barrier_timeout": 900,
        "rebuild_fallback": True,
    }
    assert parse_extra_vars(["{image_cache_keep: 2}"]) == {"image_cache_keep": 2}


def test_at_file_reads_a_yaml_or_a_json_vars_file(tmp_path):
    (tmp_path / "vars.yml").write_text("barrier_timeout: 900\npreflight_checks: [docker]\n")
    (tmp_path / "vars.json").write_text(json.dumps({"image_cache_keep": 2}))
    given = parse_extra_vars([f"@{tmp_path / 'vars.yml'}", f"@{tmp_path / 'vars.json'}"])
    assert given == {"barrier_timeout": 900, "preflight_checks": ["docker"], "image_cache_keep": 2}


def test_a_later_e_wins():
    assert parse_extra_vars(["barrier_timeout=1", '{"barrier_timeout": 2}', "barrier_timeout=3"]) == {
        "barrier_timeout": 3
    }


def test_a_word_without_equals_is_refused_with_the_forms_accepted():
    with pytest.raises(SettingsError) as refused:
        parse_extra_vars(["barrier_timeout"])
    assert "-e barrier_timeout: 'barrier_timeout' is no KEY=VALUE" in str(refused.value)
    assert all(form in str(refused.value) for form in ("KEY=VALUE", "JSON or YAML mapping", "@FILE"))


def test_an_unknown_setting_is_refused_naming_the_e_and_the_setting_it_is_closest_to():
    with pytest.raises(SettingsError, match=r"-e barrier_timout=42: unknown setting 'barrier_timout' \(did you mean "):
        parse_extra_vars(["barrier_timout=42"])
    with pytest.raises(SettingsError, match="did you mean barrier_timeout"):
        parse_extra_vars(['{"barrier_timout": 42}'])


def test_a_mapping_e_that_is_a_list_says_a_mapping_is_expected():
    with pytest.raises(SettingsError, match=r"-e \[1, 2\]: expected a mapping of setting names to values, got a list"):
        parse_extra_vars(["[1, 2]"])


def test_malformed_yaml_in_a_vars_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "vars.yml"
    path.write_text("barrier_timeout: 900\nheartbeat_stale: [5\n")
    with pytest.raises(SettingsError, match=rf"{path}: not valid YAML: line 3 "):
        parse_extra_vars([f"@{path}"])


def test_a_missing_vars_file_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        parse_extra_vars([f"@{tmp_path / 'nope.yml'}"])


def test_settings_errors_are_the_users_to_fix():
    assert issubclass(SettingsError, UserError)


# --- the site and user files ---------------------------------------------------------------------------------------


def test_the_files_default_to_the_site_path_and_the_users_config_dir():
    assert site_config_path({}) == "/etc/slurm-multi/site.yml"
    assert user_settings_path({"HOME": "/home/alice"}) == "/home/alice/.config/slurm-multi/settings.yml"
    assert user_settings_path({"HOME": "/home/alice", "SLURM_MULTI_SETTINGS": "/x.yml"}) == "/x.yml"


def test_no_files_give_no_settings(files):
    environ, _, _ = files
    assert read_settings(environ).values == {} and read_settings(environ).node_addresses == {}


def test_the_user_file_wins_over_the_site_file_and_the_environment_over_both(files):
    environ, site, user = files
    site.write_text(
        "node_addresses:\n  node1: 10.0.0.1\n"
        "settings:\n  barrier_timeout: 900\n  heartbeat_stale: 60\n  results_dir: /site/results\n"
    )
    user.write_text("heartbeat_stale: 45\nresults_dir: /mine/results\n")
    settings = read_settings(dict(environ, SLURM_MULTI_RESULTS_DIR="/env/results"))
    assert settings.values == {"barrier_timeout": 900, "heartbeat_stale": 45, "results_dir": "/env/results"}
    assert settings.node_addresses == {"node1": "10.0.0.1"}


def test_each_settings_environment_variable_is_the_tables(files):
    environ, _, _ = files
    given = dict(environ, MAD_DOCKER_BUILDS="/shared/cache", SLURM_MULTI_MODE="pull")
    assert read_settings(given).values == {"image_cache_dir": "/shared/cache", "mode": "pull"}


def test_the_site_file_given_explicitly_wins_over_the_environment_variable(files, tmp_path):
    environ, _, _ = files
    (tmp_path / "other-site.yml").write_text("settings:\n  image_cache_keep: 1\n")
    assert read_settings(environ, site_config=str(tmp_path / "other-site.yml")).values == {"image_cache_keep": 1}


def test_malformed_yaml_in_the_user_file_names_the_file_and_line(files):
    environ, _, user = files
    user.write_text("barrier_timeout: 900\n  heartbeat_stale: 5\n")
    with pytest.raises(SettingsError, match=rf"{user}: not valid YAML: line 2 "):
        read_settings(environ)


def test_a_user_file_that_is_not_a_mapping_says_the_shape_expected(files):
    environ, _, user = files
    user.write_text("- barrier_timeout\n")
    with pytest.raises(SettingsError, match=rf"{user}: expected a mapping \(setting: value\), got a list"):
        read_settings(environ)


def test_an_unknown_setting_in_a_file_is_refused_naming_the_file_and_the_closest(files):
    environ, site, user = files
    user.write_text("heartbeat_stal: 5\n")
    with pytest.raises(SettingsError, match=rf"{user}: unknown setting 'heartbeat_stal' \(did you mean heartbeat_"):
        read_settings(environ)
    user.write_text("")
    site.write_text("settings:\n  Barrier_Timeout: 5\n")
    with pytest.raises(SettingsError, match=rf"{site}: unknown setting 'Barrier_Timeout' \(did you mean barrier_t"):
        read_settings(environ)


def test_an_unknown_key_of_the_site_file_is_refused_with_the_keys_it_holds(files):
    environ, site, _ = files
    site.write_text("setting:\n  barrier_timeout: 5\n")
    with pytest.raises(SettingsError, match=rf"{site}: unknown key 'setting' \(did you mean settings\?\); it holds "):
        read_settings(environ)


def test_site_settings_that_are_not_a_mapping_are_refused(files):
    environ, site, _ = files
    site.write_text("settings: [barrier_timeout]\n")
    with pytest.raises(SettingsError, match=rf"{site}: settings must map setting names to values"):
        read_settings(environ)


@pytest.mark.parametrize("name", ["manifest_path", "use_image", "credentials_file", "secrets_file"])
def test_a_file_may_not_give_what_one_job_runs(files, name):
    environ, _, user = files
    user.write_text(f"{name}: x\n")
    with pytest.raises(SettingsError, match=rf"{user}: {name} belongs to one job, not to every job"):
        read_settings(environ)


def test_the_labs_site_file_gives_its_nodes_addresses_and_its_shared_tmp_image_cache(files):
    from slurm_multi.lab import cluster as lab

    environ, site, _ = files
    site.write_text(lab._site_config(lab.lab_nodes(2)))
    settings = read_settings(environ)
    assert settings.node_addresses == {"node1": "127.0.0.11", "node2": "127.0.0.12"}
    assert settings.values["image_cache_dir"] == "/tmp/slurm-multi-image-cache-%u"
    # The runtime with no daemon: the lab's bases by their BASE_DOCKER names, the unpack dir in node-local storage.
    assert settings.values["charliecloud_bases"][lab.PYTORCH_BASE] == str(lab.PYTORCH_BASE_TAR)
    assert settings.values["charliecloud_unpack_dir"] == str(lab.LAB_UNPACK_DIR)
    assert str(lab.SITE_CONFIG) == site_config_path({})  # one path for the lab, the inventory and the CLI


# --- who may write the files: tried by real users (tests/support/users/local_users.py) -------------------------


@pytest.fixture
def users_files():
    """(site file, user file, HOME): USER's files, not yet written, in a dir every user can reach; USER's own HOME."""
    user = ensure_user(USER)
    ensure_user(HOSTILE)
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-settings-"))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir(mode=0o700)
    os.chown(home, user.pw_uid, user.pw_gid)
    for name in ("site.yml", "settings.yml"):  # empty, root's, until a test writes them: the variables name them
        (base / name).touch(mode=0o644)
    yield base / "site.yml", base / "settings.yml", home
    shutil.rmtree(base)


def _write_as(path: Path, text: str, owner: str, mode: int) -> None:
    path.write_text(text)
    owned = pwd.getpwnam(owner)
    os.chown(path, owned.pw_uid, ensure_group(TEAM).gr_gid)
    path.chmod(mode)


def _dry_run_as_user(site: Path, user_file: Path, home: Path):
    env = {"SLURM_MULTI_SITE_CONFIG": str(site), "SLURM_MULTI_SETTINGS": str(user_file)}
    done = slurm_multi_as(USER, ["submit", "--dry-run", "-N", "2", "--tags", "dummy"], home=str(home), env=env)
    return done, done.stdout + done.stderr


@pytest.mark.parametrize("which", ["site", "user"])
def test_a_settings_file_its_group_may_write_is_refused_at_submit_naming_it(users_files, which):
    site, user_file, home = users_files
    path = site if which == "site" else user_file
    _write_as(path, "settings:\n  barrier_timeout: 900\n" if which == "site" else "barrier_timeout: 900\n", USER, 0o664)

    done, said = _dry_run_as_user(site, user_file, home)

    assert done.returncode == 2, said
    assert f"{path} is writable by its group {TEAM}" in said and f"chmod go-w {path}" in said, said
    assert "Dry run" not in said


def test_a_site_file_another_user_owns_is_refused_at_submit_naming_its_owner(users_files):
    site, user_file, home = users_files
    _write_as(site, "node_addresses:\n  node1: 10.6.6.6\n", HOSTILE, 0o644)

    done, said = _dry_run_as_user(site, user_file, home)

    assert done.returncode == 2, said
    assert f"{site} is owned by {HOSTILE} (uid {pwd.getpwnam(HOSTILE).pw_uid}), not by you or root" in said, said
    assert f"chown root {site}" in said and "10.6.6.6" not in said


def test_settings_files_of_the_user_and_root_that_only_their_owner_may_write_are_read(users_files):
    site, user_file, home = users_files
    _write_as(site, "settings:\n  barrier_timeout: 900\n", "root", 0o644)
    _write_as(user_file, "heartbeat_stale: 45\n", USER, 0o600)

    done, said = _dry_run_as_user(site, user_file, home)

    assert done.returncode == 0, said
    assert '"barrier_timeout": 900' in said and '"heartbeat_stale": 45' in said
