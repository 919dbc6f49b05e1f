"""Each role's contract: its inputs in meta/argument_specs.yml (Ansible checks them when the role starts), every
input of defaults/main.yml among them, and a README. A role reads the settings of group_vars/all.yml under their
own names, each typed, with its one default left in group_vars; defaults/main.yml holds only the role's own."""

import json
import re

import jinja2
import pytest
import yaml

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTINGS
from tests.support.ansible import ROOT, ansible_env, run_ansible

ROLES = sorted(path.name for path in (ROOT / "roles").iterdir() if (path / "tasks" / "main.yml").is_file())
# Keys whose value Ansible reads as a bare Jinja expression.
CONDITIONS = {"when", "that", "changed_when", "failed_when", "until"}


def _options(role):
    spec = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    return spec["argument_specs"]["main"]["options"]


def _defaults(role):
    return yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {}


def _templates(node, key=None):
    """Every Jinja template in a loaded YAML document, a bare condition wrapped as one."""
    if isinstance(node, dict):
        for child_key, child in node.items():
            yield from _templates(child, child_key)
    elif isinstance(node, list):
        for child in node:
            yield from _templates(child, key)
    elif isinstance(node, str):
        yield "{{ " + node + " }}" if key in CONDITIONS else node


def _variables_read(role):
    """The variables a role's tasks, vars and defaults read: the Jinja names that are no attribute, filter, test
    or keyword argument."""
    names = set()
    for folder in ("tasks", "vars", "defaults"):
        for path in sorted((ROOT / "roles" / role / folder).glob("*.yml")):
            for template in _templates(yaml.safe_load(path.read_text())):
                lexed = [token[1:] for token in jinja2.Environment().lex(template) if token[1] != "whitespace"]
                tokens = [("", ""), *lexed, ("", "")]  # (kind, value); an edge reads as no token
                for before, (kind, value), after in zip(tokens, tokens[1:], tokens[2:], strict=False):
                    attribute_filter_or_test = before[0] in ("dot", "pipe") or before[1] == "is"
                    if kind == "name" and not attribute_filter_or_test and after[0] != "assign":
                        names.add(value)
    return names


@pytest.mark.parametrize("role", ROLES)
def test_every_input_of_the_role_is_in_its_argument_spec_with_its_default_and_it_has_a_readme(role):
    options = _options(role)
    defaults = _defaults(role)
    assert set(defaults) <= set(options), f"{role}: inputs without a spec: {sorted(set(defaults) - set(options))}"
    documented = {name: options[name].get("default") for name in defaults}
    assert documented == defaults, f"{role}: the spec's defaults differ from defaults/main.yml's"
    assert all(option["description"] for option in options.values())
    assert (ROOT / "roles" / role / "README.md").read_text().startswith(f"# {role}\n")


@pytest.mark.parametrize("role", ROLES)
def test_the_role_lists_the_settings_it_reads_under_their_own_names_and_no_input_it_does_not_read(role):
    read, options = _variables_read(role), set(_options(role))
    assert read & set(SETTINGS) == options & set(SETTINGS), (
        f"{role} reads settings its spec lacks, or not those it lists"
    )
    assert options <= read, f"{role} never reads its inputs {sorted(options - read)}"


@pytest.mark.parametrize("role", ROLES)
def test_the_role_gives_no_setting_a_second_name_or_a_second_default(role):
    aliases = {name: value for name, value in _defaults(role).items() if "{{" in str(value)}
    assert aliases == {}, f"{role}'s defaults/main.yml names settings again: {aliases}"
    shadowed = sorted(set(_defaults(role)) & set(SETTINGS))
    assert shadowed == [], f"{role}'s defaults/main.yml holds a default of group_vars settings: {shadowed}"
    defaulted = sorted(name for name, option in _options(role).items() if name in SETTINGS and "default" in option)
    assert defaulted == [], f"{role}'s argument spec gives group_vars settings a default: {defaulted}"


@pytest.mark.parametrize("role", ROLES)
def test_the_role_requires_the_play_to_give_each_setting_whose_default_is_not_null(role):
    # A role run without group_vars/all.yml stops at its start, naming the settings missing; ansible-doc shows
    # them required instead of "default: null". A setting whose default is null can be null: not required.
    settings = {name: option for name, option in _options(role).items() if name in SETTINGS}
    required = {name for name, option in settings.items() if option.get("required")}
    assert required == {name for name in settings if SETTINGS[name].default is not None}


@pytest.mark.parametrize("role", ROLES)
def test_the_roles_inputs_have_real_types(role):
    options = _options(role)
    mistyped = {
        name: option["type"]
        for name, option in options.items()
        if name in SETTINGS and option["type"] != SETTINGS[name].kind
    }
    assert mistyped == {}, f"{role}: settings typed unlike their one home (module_utils/job/defaults.py)"
    # Its own inputs: raw only for one taking several types, which its description names.
    raw = sorted(name for name, option in options.items() if name not in SETTINGS and option["type"] == "raw")
    assert raw in ([], ["postprocessing_attempt"]), f"{role}: inputs typed raw: {raw}"


def test_every_roles_argument_spec_accepts_the_group_vars_defaults(tmp_path):
    specs = []
    for role in ROLES:
        specs.append(tmp_path / f"{role}.json")
        specs[-1].write_text(json.dumps({n: o for n, o in _options(role).items() if n in SETTINGS}))
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        f"- hosts: localhost\n  gather_facts: false\n  vars_files: [{ROOT / 'group_vars' / 'all.yml'}]\n  tasks:\n"
        "    - ansible.builtin.validate_argument_spec:\n"
        "        argument_spec: \"{{ lookup('ansible.builtin.file', item) | from_json }}\"\n"
        f"      loop: {json.dumps([str(spec) for spec in specs])}\n"
    )
    result = run_ansible(["ansible-playbook", "-i", "localhost,", "-c", "local", str(playbook)])
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize(
    "role, name, value, wanted",
    [("running", "running_stop_grace", "soon", "int"), ("preflight", "preflight_max_clock_skew", "soon", "float")],
)
def test_ansible_refuses_an_input_of_the_wrong_type_by_its_name_before_the_role_runs(
    tmp_path, role, name, value, wanted
):
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        f"- hosts: localhost\n  gather_facts: false\n  vars_files: [{ROOT / 'group_vars' / 'all.yml'}]\n  tasks:\n"
        f"    - ansible.builtin.include_role:\n        name: {role}\n"
    )
    result = run_ansible(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", str(playbook), "-e", json.dumps({name: value})]
    )
    assert result.returncode != 0
    assert "Validation of arguments failed" in result.stdout, result.stdout[-2000:]
    assert name in result.stdout and wanted in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("role", ROLES)
def test_ansible_doc_renders_the_roles_inputs(role):
    result = run_ansible(
        ["ansible-doc", "-t", "role", "-r", str(ROOT / "roles"), role], env=ansible_env(ANSIBLE_NOCOLOR="1")
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"ENTRY POINT: \W*main\b", result.stdout), result.stdout
    missing = [name for name in _options(role) if name not in result.stdout]
    assert missing == [], f"ansible-doc shows no {missing}:\n{result.stdout}"
    assert "WARNING" not in result.stderr, result.stderr


def test_the_pipeline_refuses_a_stages_input_of_the_wrong_type_before_any_node_work():
    # run_multi.yml checks every stage's inputs once, on the controller, instead of each role on every node.
    result = run_ansible(
        ["ansible-playbook", str(ROOT / "playbooks" / "run_multi.yml"), "-e", "running_stop_grace=soon"]
    )
    assert result.returncode != 0
    assert "Validation of arguments failed" in result.stdout and "running_stop_grace" in result.stdout
    assert "Check every node before anything expensive" not in result.stdout, result.stdout[-2000:]
