"""module_utils/job/defaults.py is the one home of the results dir, image cache dir and image transport defaults:
group_vars/all.yml reads it through the `pipeline_default` filter, the CLI and node selection import it."""

import json

import pytest

from ansible.module_utils.job import defaults
from tests.support.ansible import ROOT, ansible_env, run_ansible

SHOW_DEFAULTS = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "{{ {'results_dir': results_dir, 'image_cache_dir': image_cache_dir, 'image_transport': image_transport}
                 | to_json }}"
"""


def test_the_results_dir_is_the_environments_else_one_in_home():
    assert defaults.default_results_dir({"HOME": "/home/alice"}) == "/home/alice/slurm-multi-results"
    environ = {"HOME": "/home/alice", "SLURM_MULTI_RESULTS_DIR": "/shared/results"}
    assert defaults.default_results_dir(environ) == "/shared/results"


def test_an_unknown_default_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="no pipeline default named 'result_dir': results_dir, image_cache_dir"):
        defaults.pipeline_default("result_dir")


def test_group_vars_defaults_are_the_modules(tmp_path):
    # A playbook beside the project's group_vars, as playbooks/ has it.
    (tmp_path / "group_vars").symlink_to(ROOT / "group_vars")
    (tmp_path / "show.yml").write_text(SHOW_DEFAULTS)
    env = ansible_env(HOME=str(tmp_path), SLURM_MULTI_RESULTS_DIR=str(tmp_path / "results"))
    result = run_ansible(["ansible-playbook", "-i", "localhost,", str(tmp_path / "show.yml")], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout.split("msg: '", 1)[1].split("'\n", 1)[0])
    assert shown == {
        "results_dir": str(tmp_path / "results"),
        "image_cache_dir": defaults.IMAGE_CACHE_DIR,
        "image_transport": defaults.IMAGE_TRANSPORT,
    }
