"""The speed-up layer (slurm_multi/speedup/, docs/speedup.md) is optional and safe to lose: one setting turns every
part of it off, it steps aside with one warning on an ansible-core whose private names it uses changed, and no other
product file imports a private name of ansible-core. Real playbooks through slurm-multi-playbook, with a stand-in
`srun` that only records the servers' step it is asked to start."""

import ast
import importlib.machinery
import importlib.util
import os
import re
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTINGS
from slurm_multi.speedup import switch
from tests.support.ansible import BIN, ROOT, ansible_env, run_ansible
from tests.support.changed_ansible import changed_ansible

ROOM = ROOT / "slurm_multi" / "speedup"
# The one file of the room that names ansible-core's private modules and names.
SEAM = ROOM / "ansible_private.py"
PRODUCT_TREES = ("module_utils", "library", "plugins", "slurm_multi", "bin")

# A push play on a node reached through srun (whose start starts the module servers' step), then a module on the
# controller that says what $SLURM_MULTI_SPEEDUP the playbook handed its processes.
PLAYBOOK = """
- hosts: node9
  gather_facts: false
  tasks:
    - ansible.builtin.debug: {msg: on the node}
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.command: sh -c 'echo "handed speedup=${SLURM_MULTI_SPEEDUP:-unset}"'
      register: handed
    - ansible.builtin.debug: {msg: "{{ handed.stdout }}"}
"""
FAKE_SRUN = '#!/bin/sh\necho "$@" >> "$(dirname "$0")/srun.calls"\n'
STEPS_ASIDE = "slurm-multi's speed-up layer steps aside"


class Ran:
    def __init__(self, result, work: Path):
        self.rc, self.output = result.returncode, result.stdout + result.stderr
        calls = work / "bin" / "srun.calls"
        self.servers_steps = calls.read_text().splitlines() if calls.exists() else []
        cache = work / "cache" / "slurm-multi"
        self.kept = sorted(path.name for path in cache.iterdir()) if cache.is_dir() else []
        handed = re.search(r"handed speedup=(\w+)", self.output)
        self.handed = handed.group(1) if handed else None


def _playbook(work: Path, *options, command="slurm-multi-playbook", **env) -> Ran:
    """PLAYBOOK through slurm-multi-playbook, as the job script runs it (or `command`), in an allocation of one node
    (node9)."""
    (work / "bin").mkdir(exist_ok=True)
    (work / "bin" / "srun").write_text(FAKE_SRUN)
    (work / "bin" / "srun").chmod(0o755)
    (work / "play.yml").write_text(PLAYBOOK)
    (work / "inventory.ini").write_text(
        f"node9 ansible_connection=srun\nlocalhost ansible_connection=local ansible_python_interpreter={BIN}/python\n"
    )
    for name in ("site.yml", "settings.yml"):  # empty unless a test wrote them: the variables name them
        (work / name).touch()
    environment = ansible_env(
        PATH=f"{work / 'bin'}:{BIN}:{os.environ['PATH']}",
        ANSIBLE_INVENTORY_ENABLED="ini",
        SLURM_JOB_ID="77",
        SLURM_JOB_NUM_NODES="1",
        XDG_CACHE_HOME=str(work / "cache"),
        SLURM_MULTI_SITE_CONFIG=str(work / "site.yml"),
        SLURM_MULTI_SETTINGS=str(work / "settings.yml"),
        **env,
    )
    argv = [command, "-i", str(work / "inventory.ini"), str(work / "play.yml"), *options]
    return Ran(run_ansible(argv, env=environment, timeout=180), work)


def test_with_the_layer_on_every_part_works(tmp_path):
    ran = _playbook(tmp_path)
    assert ran.rc == 0, ran.output[-3000:]
    (step,) = ran.servers_steps
    assert step.endswith("-m slurm_multi.speedup.module_server")
    assert ran.kept == ["ansiballz", "routing", "templates"]
    assert ran.handed == "1" and STEPS_ASIDE not in ran.output


def test_speedup_false_turns_every_part_off(tmp_path):
    ran = _playbook(tmp_path, "-e", "speedup=false")
    assert ran.rc == 0, ran.output[-3000:]
    # No module servers' step, nothing kept or taken, and every node's module client told to run fresh.
    assert (ran.servers_steps, ran.kept, ran.handed) == ([], [], "0")
    assert "[WARNING]" not in ran.output


def test_on_an_ansible_core_without_a_private_name_every_part_steps_aside_with_one_warning(tmp_path):
    stand_in = changed_ansible(tmp_path / "changed-ansible")
    ran = _playbook(tmp_path, PYTHONPATH=str(stand_in))
    assert ran.rc == 0, ran.output[-3000:]
    assert (ran.servers_steps, ran.kept, ran.handed) == ([], [], "0")
    assert ran.output.count(STEPS_ASIDE) == 1, ran.output
    assert "No module named 'ansible._internal._templating._jinja_bits'" in ran.output


def test_without_the_layers_package_a_raw_ansible_playbook_runs_plain_saying_so_once(tmp_path):
    # A Python whose slurm_multi cannot import its speedup/: the callbacks ansible.cfg enables load, and do nothing.
    (tmp_path / "python" / "slurm_multi" / "speedup").mkdir(parents=True)
    (tmp_path / "python" / "slurm_multi" / "__init__.py").write_text("")
    (tmp_path / "python" / "slurm_multi" / "speedup" / "__init__.py").write_text("raise ImportError('no layer here')\n")
    ran = _playbook(tmp_path, command="ansible-playbook", PYTHONPATH=str(tmp_path / "python"))
    assert ran.rc == 0, ran.output[-3000:]
    assert (ran.servers_steps, ran.kept) == ([], [])
    assert ran.output.count("slurm-multi's speed-up layer is not in this Python") == 1, ran.output


def test_a_speedup_neither_true_nor_false_turns_the_layer_off_naming_it(tmp_path):
    ran = _playbook(tmp_path, "-e", "speedup=sometimes")
    assert ran.rc == 0, ran.output[-3000:]
    assert (ran.servers_steps, ran.kept, ran.handed) == ([], [], "0")
    assert ran.output.count("the setting speedup is 'sometimes' (-e), which is neither true nor false") == 1


@pytest.mark.parametrize(
    ("site_file", "variable", "options", "handed"),
    [
        ("settings: {speedup: false}\n", "", (), "0"),
        ("settings: {speedup: false}\n", "1", (), "1"),
        ("", "0", ("-e", '{"speedup": true}'), "1"),
    ],
    ids=["site-file", "its-variable-over-the-site-file", "e-over-its-variable"],
)
def test_the_setting_is_the_e_else_its_variable_else_the_files(tmp_path, site_file, variable, options, handed):
    (tmp_path / "site.yml").write_text(site_file)
    ran = _playbook(tmp_path, *options, **({"SLURM_MULTI_SPEEDUP": variable} if variable else {}))
    assert ran.rc == 0, ran.output[-3000:]
    assert ran.handed == handed


def test_the_settings_variable_and_words_are_the_switchs_and_the_clients():
    # The client runs without the project on its path: it has its own copy of both.
    loader = importlib.machinery.SourceFileLoader("module_client", str(ROOM / "slurm-multi-module-client"))
    client = importlib.util.module_from_spec(importlib.util.spec_from_loader("module_client", loader))
    loader.exec_module(client)
    assert SETTINGS["speedup"].env == switch.ENV == client.SPEEDUP_ENV
    assert switch.OFF_WORDS == client.OFF_WORDS
    assert f"${{{switch.ENV}:-}}" in (ROOM / "slurm-multi-module-python").read_text()


def _private_ansible_imports(path: Path, root: Path = ROOT) -> list:
    """The private modules and names of ansible-core that a Python file imports (a dotted part or a name with a
    leading underscore), import_module's strings included; [] for a file that is not Python."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            modules = [node.value] if re.fullmatch(r"ansible(\.\w+)+", node.value) else []
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "ansible" and any(_private(part) for part in parts[1:]):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {module}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _product_files():
    for tree in PRODUCT_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def test_no_product_file_outside_the_speedup_room_imports_a_private_name_of_ansible_core():
    outside = [path for path in _product_files() if ROOM not in path.parents]
    assert [found for path in outside for found in _private_ansible_imports(path)] == []


def test_inside_the_room_only_ansible_private_py_imports_them():
    inside = [path for path in _product_files() if ROOM in path.parents and path != SEAM]
    assert [found for path in inside for found in _private_ansible_imports(path)] == []
    assert "ansible._internal._templating._jinja_bits" in " ".join(_private_ansible_imports(SEAM))


def test_the_static_check_finds_a_private_import(tmp_path):
    # A check that found nothing in any file would pass the two tests above as well.
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import ansible._internal._datatag\nfrom ansible.utils.collection_loader import _collection_finder\n"
        "importlib.import_module('ansible.module_utils._internal')\nfrom ansible.module_utils import basic\n"
    )
    found = [line.split(": ", 1)[1] for line in _private_ansible_imports(planted, tmp_path)]
    assert found == [
        "ansible._internal._datatag",
        "ansible.utils.collection_loader._collection_finder",
        "ansible.module_utils._internal",
    ]
