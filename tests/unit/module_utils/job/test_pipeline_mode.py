"""The pipeline mode is one fact: set in group_vars/all.yml (`mode`), read in the roles and plays as `pull_mode`
alone, and named in Python by module_utils/job/pipeline_mode.py alone."""

import re
from pathlib import Path

import yaml

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import DEFAULT_MODE, MODES, PULL

ROOT = Path(__file__).resolve().parents[4]
GROUP_VARS = ROOT / "group_vars" / "all.yml"
ANSIBLE_CONTENT = ("roles", "playbooks", "group_vars")
PYTHON_CONTENT = ("slurm_multi", "plugins", "library", "module_utils")


def test_group_vars_takes_the_default_mode_from_the_settings_home_and_derives_pull_mode_from_it():
    settings = yaml.safe_load(GROUP_VARS.read_text())
    assert settings["mode"] == "{{ 'mode' | slurm_multi.pipeline.pipeline_default }}"
    assert DEFAULT_MODE == SETTING_DEFAULTS["mode"] and DEFAULT_MODE in MODES
    assert settings["pull_mode"] == "{{ mode == '" + PULL + "' }}"


def test_no_role_or_play_reads_mode_but_through_pull_mode_or_the_guard():
    readings = re.compile(r"\bmode\s*(\|\s*default|==|!=)|\bmode \| slurm_multi\.pipeline\.node_play_problems")
    found = sorted(
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for folder in ANSIBLE_CONTENT
        for path in (ROOT / folder).rglob("*.yml")
        for line in path.read_text().splitlines()
        if readings.search(line) and "molecule" not in path.parts
    )
    assert found == [
        "group_vars/all.yml: pull_mode: \"{{ mode == 'pull' }}\"",
        "roles/node_play_guards/tasks/main.yml: {{ mode | slurm_multi.pipeline.node_play_problems(allocation_nodes, "
        "ansible_play_hosts_all, ansible_play_batch,",
    ]


def test_no_python_file_spells_a_mode_of_its_own():
    spelled = re.compile(r"""mode\s*(==|!=|not in|in)\s*\(?["'](push|pull)["']""")
    found = [
        str(path.relative_to(ROOT))
        for folder in PYTHON_CONTENT
        for path in (ROOT / folder).rglob("*.py")
        if spelled.search(path.read_text())
    ]
    assert found == []
