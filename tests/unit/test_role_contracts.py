"""Each role's contract: its inputs in meta/argument_specs.yml (Ansible checks them when the role starts), every
input of defaults/main.yml among them, and a README."""

import json

import pytest
import yaml

from tests.support.ansible import ROOT, run_ansible

ROLES = sorted(path.name for path in (ROOT / "roles").iterdir() if (path / "tasks" / "main.yml").is_file())


@pytest.mark.parametrize("role", ROLES)
def test_every_input_of_the_role_is_in_its_argument_spec_and_it_has_a_readme(role):
    defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {}
    spec = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert set(defaults) <= set(options), f"{role}: inputs without a spec: {sorted(set(defaults) - set(options))}"
    assert all(option["description"] for option in options.values())
    assert (ROOT / "roles" / role / "README.md").read_text().startswith(f"# {role}\n")


def test_ansible_refuses_an_input_of_the_wrong_type_before_the_role_runs(tmp_path):
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        f"- hosts: localhost\n  gather_facts: false\n  vars_files: [{ROOT / 'group_vars' / 'all.yml'}]\n  tasks:\n"
        "    - ansible.builtin.include_role:\n        name: running\n"
    )
    result = run_ansible(
        [
            "ansible-playbook",
            "-i",
            "localhost,",
            "-c",
            "local",
            str(playbook),
            "-e",
            json.dumps({"running_stop_grace": "soon"}),
        ]
    )
    assert result.returncode != 0
    assert "running_stop_grace" in result.stdout and "int" in result.stdout, result.stdout[-2000:]
