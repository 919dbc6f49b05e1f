"""The slurm_multi.pipeline collection `make collection` builds (slurm_multi/collection.py), installed outside the
checkout: real files for the checkout's links, every module documented by its full name, the allocation's nodes
reached through the collection's srun connection. tests/integration/test_collection_lab.py runs its lab job."""

import json
import subprocess
import tarfile
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from slurm_multi.collection import SKELETON
from tests.support.ansible import BIN, ROOT
from tests.support.collection import install_built_collection, user_env

MODULES = sorted(path.stem for path in (ROOT / "library").glob("*.py"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_built_collection(tmp_path_factory.mktemp("collection"))


def _py_files(folder):
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def test_the_tarball_holds_the_checkouts_modules_module_utils_and_plugins_as_files(installed):
    with tarfile.open(installed.tarball) as tarball:
        members = {member.name: member for member in tarball.getmembers()}
    assert all(member.isfile() or member.isdir() for member in members.values()), "a link in the tarball"
    shipped = set(members)
    for source, target in [("library", "plugins/modules"), ("module_utils", "plugins/module_utils")] + [
        (f"plugins/{kind}", f"plugins/{kind}") for kind in ("action", "callback", "connection", "filter", "inventory")
    ]:
        missing = {f"{target}/{name}" for name in _py_files(ROOT / source)} - shipped
        assert not missing, missing
    for role in ("preflight", "preparation", "build", "running", "postprocessing", "node_play_guards"):
        assert f"roles/{role}/tasks/main.yml" in shipped and f"roles/{role}/meta/argument_specs.yml" in shipped
    assert not any("/molecule/" in name for name in shipped)
    for path in ("playbooks/run_multi.yml", "playbooks/group_vars/all.yml", "meta/runtime.yml", "models/models.json"):
        assert path in shipped, path


def test_the_playbooks_group_vars_are_the_checkouts(installed):
    shipped = installed.root / "playbooks" / "group_vars" / "all.yml"
    assert shipped.read_text() == (ROOT / "group_vars" / "all.yml").read_text()


def test_ansible_doc_renders_every_module_by_its_full_name_from_the_installed_collection(installed, tmp_path):
    names = [f"slurm_multi.pipeline.{module}" for module in MODULES]
    result = subprocess.run(
        [str(BIN / "ansible-doc"), *names],
        cwd=tmp_path,
        env=user_env(installed.collections_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    for name in names:
        # "> MODULE slurm_multi.pipeline.run_model (/.../plugins/modules/run_model.py)", its fragments merged.
        assert f"MODULE {name} ({installed.root}/plugins/modules/" in result.stdout, name
    assert result.stdout.count("OPTIONS") >= len(names) and result.stdout.count("RETURN VALUES:") == len(names)
    assert "WARNING" not in result.stderr and "ERROR" not in result.stderr, result.stderr


def test_the_installed_inventory_reaches_the_other_nodes_through_the_collections_srun(installed, tmp_path):
    allocation = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2"}
    result = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(installed.root / "inventory" / "slurm.yml"), "--list"],
        cwd=tmp_path,
        env=user_env(installed.collections_path, **allocation),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    hostvars = json.loads(result.stdout)["_meta"]["hostvars"]
    # An installed collection's plugins have only their full name (the checkout's inventory says "srun").
    assert {node: hostvars[node]["ansible_connection"]["__ansible_unsafe"] for node in ("gpu01", "gpu02")} == {
        "gpu01": "slurm_multi.pipeline.srun",
        "gpu02": "slurm_multi.pipeline.srun",
    }


def test_the_collection_requires_the_ansible_core_the_package_depends_on():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (core,) = [Requirement(dep) for dep in project["dependencies"] if Requirement(dep).name == "ansible-core"]
    runtime = yaml.safe_load((ROOT / SKELETON / "meta" / "runtime.yml").read_text())
    assert SpecifierSet(runtime["requires_ansible"]) == core.specifier
