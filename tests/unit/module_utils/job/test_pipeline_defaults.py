"""module_utils/job/defaults.py is the one home of every setting (its default, type, flag and environment variable):
group_vars/all.yml reads each default through the `pipeline_default` filter, the modules' options, the checks' own
fallbacks, the roles' argument specs, the CLI's flags and node selection take it or are held equal to it here, and
docs/settings.md is generated from it."""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import defaults
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from slurm_multi import cli, settings_doc
from slurm_multi.spec import JobSpec
from slurm_multi.submission import node_selection
from slurm_multi.submission.sbatch import SlurmOptions
from tests.support.ansible import ROOT, ansible_env, run_ansible

# Each setting's option in the modules that take it (a module called directly gets the same default).
# rank_barrier's and run_model's heartbeat_stale default to 0, off: a module called alone watches no heartbeat.
MODULE_OPTIONS = [
    ("preflight_max_clock_skew", "node_preflight", "max_clock_skew"),
    ("preflight_disk_headroom_gb", "node_preflight", "disk_headroom_gb"),
    ("preflight_checks", "node_preflight", "checks"),
    ("image_cache_teach_digests", "image_cache", "teach_digests"),
    ("image_cache_keep", "image_cache", "keep"),
    ("image_cache_max_age_days", "image_cache", "max_age_days"),
    ("buildkit_docker_cli", "build_images", "buildkit_docker_cli"),
    ("barrier_timeout", "rank_barrier", "timeout"),
    ("barrier_port_range", "rank_barrier", "port_range"),
    ("job_end_margin", "run_model", "end_margin"),
    ("hang_timeout", "run_model", "hang_timeout"),
]
# The settings whose default depends on the job, spelled out in group_vars/all.yml.
COMPUTED_IN_GROUP_VARS = {
    "results_dir": "{{ 'results_dir' | slurm_multi.pipeline.pipeline_default }}",
    "models_file": "{{ playbook_dir }}/../models/models.json",
    "image_cache_dir": "{{ results_dir }}/image-cache-%u",
}
# group_vars/all.yml's names that are derived from settings, not settings.
DERIVED = {"pull_mode", "srun_abort_attempt_dir"}

SHOW_SETTINGS = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "{{ dict(names | zip(names | map('extract', vars))) | to_json }}"
"""


def _group_vars():
    return yaml.safe_load((ROOT / "group_vars" / "all.yml").read_text())


def test_group_vars_defines_every_setting_of_the_one_home_and_nothing_else():
    assert set(_group_vars()) - DERIVED == set(defaults.SETTINGS)


def test_group_vars_reads_each_literal_default_from_the_one_home():
    for name, value in _group_vars().items():
        if name in DERIVED:
            continue
        expected = COMPUTED_IN_GROUP_VARS.get(name, "{{ '" + name + "' | slurm_multi.pipeline.pipeline_default }}")
        assert value == expected, f"group_vars/all.yml's {name}"
    assert {name for name, s in defaults.SETTINGS.items() if s.default is defaults.COMPUTED} == set(
        COMPUTED_IN_GROUP_VARS
    )


def test_every_setting_has_a_meaning_and_a_real_type():
    for setting in defaults.SETTINGS.values():
        assert setting.doc and setting.kind in {"str", "int", "float", "bool", "list", "dict", "path", "raw"}
        if setting.default is defaults.COMPUTED:
            assert setting.computed, setting.name
        elif setting.default is not None and setting.kind != "raw":
            kinds = {"str": str, "path": str, "int": int, "float": (int, float), "bool": bool, "list": list}
            assert isinstance(setting.default, kinds.get(setting.kind, dict)), setting.name


def test_docs_settings_md_is_generated_from_the_one_home():
    assert (ROOT / "docs" / "settings.md").read_text() == settings_doc.settings_reference(), (
        "docs/settings.md is out of date: python -m slurm_multi.settings_doc > docs/settings.md"
    )


def test_each_settings_flag_is_an_option_of_submit_and_run():
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("submit", "run"):
        options = {flag for action in commands.choices[command]._actions for flag in action.option_strings}
        for setting in defaults.SETTINGS.values():
            for flag in (setting.flag or "").split(", "):
                assert not flag or flag in options, f"{setting.name}'s {flag} is no option of {command}"


def test_the_results_dir_is_the_environments_else_one_in_home():
    assert defaults.default_results_dir({"HOME": "/home/alice"}) == "/home/alice/slurm-multi-results"
    environ = {"HOME": "/home/alice", "SLURM_MULTI_RESULTS_DIR": "/shared/results"}
    assert defaults.default_results_dir(environ) == "/shared/results"


def test_an_unknown_setting_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="no setting named 'result_dir': results_dir, models_file"):
        defaults.pipeline_default("result_dir")


def test_the_playbook_gets_every_settings_default_from_the_one_home(tmp_path):
    # A playbook beside the project's group_vars, as playbooks/ has it.
    (tmp_path / "group_vars").symlink_to(ROOT / "group_vars")
    (tmp_path / "show.yml").write_text(SHOW_SETTINGS)
    env = ansible_env(HOME=str(tmp_path), SLURM_MULTI_RESULTS_DIR=str(tmp_path / "results"))
    names = json.dumps({"names": sorted(defaults.SETTINGS)})
    result = run_ansible(["ansible-playbook", "-i", "localhost,", "-e", names, str(tmp_path / "show.yml")], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout.split("msg: '", 1)[1].split("'\n", 1)[0])
    assert shown == {
        "results_dir": str(tmp_path / "results"),
        "image_cache_dir": defaults.default_image_cache_dir(str(tmp_path / "results")),
        "models_file": f"{tmp_path}/../models/models.json",
        **defaults.SETTING_DEFAULTS,
    }


def _library_module(name):
    spec = importlib.util.spec_from_file_location(f"slurm_multi_library_{name}", ROOT / "library" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setting, module_name, option", MODULE_OPTIONS)
def test_each_modules_option_and_its_doc_default_to_the_settings_one_home(setting, module_name, option):
    module = _library_module(module_name)
    documented = yaml.safe_load(module.DOCUMENTATION)["options"][option]["default"]
    default = defaults.SETTING_DEFAULTS[setting]
    if setting == "barrier_port_range":  # the option takes the range as one string
        default = "{}-{}".format(*default)
    assert module.ARGUMENT_SPEC[option]["default"] == documented == default


def test_the_checks_own_fallbacks_are_the_one_homes(monkeypatch):
    # The checks run as a plain script too (node selection's srun), given only what the caller sets.
    home = defaults.SETTING_DEFAULTS
    skewed = preflight.node_preflight(
        {"node": "n1", "checks": ["clock"], "reference_time": time.time() - (home["preflight_max_clock_skew"] - 2)}
    )
    assert skewed["problems"] == []
    monkeypatch.setattr(preflight, "docker_root_dir", lambda node: ("/var/lib/docker", None))
    monkeypatch.setattr(preflight, "free_bytes", lambda root: int((home["preflight_disk_headroom_gb"] - 1) * 1e9))
    short = preflight.node_preflight({"node": "n1", "checks": ["disk"], "image_bytes": 1})
    assert [problem["check"] for problem in short["problems"]] == ["disk"]


def test_node_selection_checks_with_the_one_homes_defaults_and_a_users_zero(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(node_selection.sbatch, "usable_nodes", lambda partition, reservation: ["node1"])
    ansible_playbook = node_selection.subprocess.run  # the settings are Ansible's real answer; srun is faked

    def run(argv, env, **kwargs):
        if argv[0] != "srun":
            return ansible_playbook(argv, env=env, **kwargs)
        seen["settings"] = json.loads(argv[argv.index("--json") + 1])
        return node_selection.subprocess.CompletedProcess(argv, 0, json.dumps({"node": "node1", "problems": []}), "")

    monkeypatch.setattr(node_selection.subprocess, "run", run)
    node_selection.select_nodes(JobSpec(tags=("dummy",), results_dir=tmp_path / "r"), SlurmOptions(nodes=1), ROOT)
    assert seen["settings"]["max_clock_skew"] == defaults.SETTING_DEFAULTS["preflight_max_clock_skew"]
    assert seen["settings"]["disk_headroom_gb"] == defaults.SETTING_DEFAULTS["preflight_disk_headroom_gb"]
    given = JobSpec(tags=("dummy",), results_dir=tmp_path / "r", extra_vars={"preflight_max_clock_skew": 0})
    node_selection.select_nodes(given, SlurmOptions(nodes=1), ROOT)
    assert seen["settings"]["max_clock_skew"] == 0


def _content_with_a_changed_default(tmp_path, setting, old, new):
    """A copy of the Ansible content whose one home gives ``setting`` the default ``new``: module_utils/ and the
    collection that names it are copied (its link then points at the copy), everything else is linked."""
    content = tmp_path / "content"
    content.mkdir()
    for name in ("ansible.cfg", "playbooks", "roles", "library", "plugins", "inventory", "group_vars", "models"):
        (content / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "module_utils", content / "module_utils", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "collections", content / "collections", symlinks=True)
    home = content / "module_utils" / "job" / "defaults.py"
    text = home.read_text()
    row = f'"{setting}",\n{" " * 16}'
    assert text.count(row + f"{old!r},") == 1, f"the table's {setting} row is not written as expected"
    home.write_text(text.replace(row + f"{old!r},", row + f"{new!r},"))
    return content


def test_a_default_changed_in_the_one_home_reaches_the_playbook_a_module_node_selection_and_the_cli(tmp_path):
    setting, old, new = "preflight_max_clock_skew", defaults.SETTING_DEFAULTS["preflight_max_clock_skew"], 1000.0
    content = _content_with_a_changed_default(tmp_path, setting, old, new)
    (tmp_path / "no-site.yml").touch()  # an empty site file: no settings of the lab's
    env = ansible_env(
        ANSIBLE_CONFIG=str(content / "ansible.cfg"),
        HOME=str(tmp_path),
        SLURM_MULTI_SITE_CONFIG=str(tmp_path / "no-site.yml"),
        SLURM_MULTI_HOME=str(content),
        # The copy's module_utils before the checkout's (its editable install), for the package's own imports.
        PYTHONPATH=f"{content / 'collections'}:{ROOT}",
    )
    # The playbook: group_vars reads the default through the pipeline_default filter.
    (tmp_path / "group_vars").symlink_to(ROOT / "group_vars")
    (tmp_path / "show.yml").write_text(SHOW_SETTINGS)
    played = run_ansible(
        ["ansible-playbook", "-i", "localhost,", "-e", json.dumps({"names": [setting]}), str(tmp_path / "show.yml")],
        env=env,
    )
    assert played.returncode == 0, played.stdout + played.stderr
    assert json.loads(played.stdout.split("msg: '", 1)[1].split("'\n", 1)[0]) == {setting: new}
    # A module called directly: a clock 500 s off is within the new bound (the old one refuses it).
    off_clock = {"node": "n1", "checks": ["clock"], "reference_time": time.time() - 500}
    paths = {"results_dir": str(tmp_path / "r"), "attempt_dir": str(tmp_path / "r" / "a")}
    module = ["-m", "node_preflight", "-a", json.dumps({**off_clock, **paths})]
    checked = run_ansible(
        ["ansible", "localhost", "-i", "localhost,", "-c", "local", *module],
        env=dict(env, ANSIBLE_PYTHON_INTERPRETER=sys.executable),
    )
    assert checked.returncode == 0 and "problems: []" in checked.stdout, checked.stdout + checked.stderr
    # Node selection: Ansible's answer for a candidate.
    spec = JobSpec(tags=("dummy",), results_dir=tmp_path / "r")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        resolved = node_selection.resolved_settings(spec, content, ["node1"])
    assert resolved["node1"][setting] == new
    # The CLI: what a job submitted from here gets.
    shown = subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", "settings"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert {line.split()[0]: line.split()[1:] for line in shown.stdout.splitlines()}[setting] == [str(new), "(default)"]
