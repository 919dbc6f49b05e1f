"""slurm-multi-playbook (slurm_multi/speedup/playbook.py): ansible-playbook with the routing file and the collection's
bytecode kept, through real Ansible code; the pipeline runs it."""

import compileall
import os
import subprocess
import sys
from pathlib import Path

import ansible
import pytest
from ansible.utils.collection_loader import _collection_finder
from ansible.utils.collection_loader._collection_meta import _meta_yml_to_dict

from slurm_multi.speedup import playbook
from slurm_multi.submission.sbatch import find_ansible_playbook

ROOT = Path(__file__).resolve().parents[4]
BUILTIN_ROUTING = Path(ansible.__file__).parent / "config" / "ansible_builtin_runtime.yml"


def _never(*_):
    raise AssertionError("parsed again, though it was kept")


def test_the_builtin_routing_is_parsed_once_then_read_as_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    raw = BUILTIN_ROUTING.read_bytes()
    first = playbook.kept_routing(_meta_yml_to_dict)(raw, ("ansible.builtin", "runtime.yml"))
    assert first == _meta_yml_to_dict(raw, None) and first["plugin_routing"]
    kept = list((tmp_path / "slurm-multi" / playbook.CACHE_NAME).iterdir())
    assert len(kept) == 1 and oct(kept[0].parent.stat().st_mode & 0o777) == "0o700"
    assert playbook.kept_routing(_never)(raw, ("ansible.builtin", "runtime.yml")) == first
    # Another file's content is another entry, never the kept one.
    assert playbook.kept_routing(_meta_yml_to_dict)(b"plugin_routing: {}\n", None) == {"plugin_routing": {}}


def test_a_damaged_kept_routing_is_parsed_and_kept_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    raw = b"plugin_routing:\n  modules:\n    ping: {redirect: ns.coll.ping}\n"
    playbook.kept_routing(_meta_yml_to_dict)(raw, None)
    (entry,) = (tmp_path / "slurm-multi" / playbook.CACHE_NAME).iterdir()
    entry.write_bytes(b"\xff not marshal")
    expected = {"plugin_routing": {"modules": {"ping": {"redirect": "ns.coll.ping"}}}}
    assert playbook.kept_routing(_meta_yml_to_dict)(raw, None) == expected
    assert playbook.kept_routing(_never)(raw, None) == expected


def test_a_cache_dir_others_can_read_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "slurm-multi" / playbook.CACHE_NAME
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    raw = b"plugin_routing: {}\n"
    assert playbook.kept_routing(_meta_yml_to_dict)(raw, None) == {"plugin_routing": {}}
    assert not list(folder.iterdir())


@pytest.fixture
def collection(tmp_path, monkeypatch):
    """A collection with one module_utils file, importable through Ansible's own collection finder."""
    utils = tmp_path / "ansible_collections" / "ns" / "coll" / "plugins" / "module_utils"
    utils.mkdir(parents=True)
    (utils / "answer.py").write_text("ANSWER = 42\n")
    for name in [m for m in sys.modules if m.startswith("ansible_collections")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "path_hooks", list(sys.path_hooks))
    monkeypatch.setattr(sys, "path_importer_cache", {})
    _collection_finder._AnsibleCollectionFinder(paths=[str(tmp_path)])._install()
    loader = _collection_finder._AnsibleCollectionPkgLoaderBase
    monkeypatch.setattr(loader, "get_code", playbook.cached_get_code(loader.get_code))
    return utils / "answer.py"


def _never_compile(*_args, **_kwargs):
    raise AssertionError("compiled from source, though its bytecode was at hand")


def test_a_collections_module_is_imported_from_its_bytecode_not_compiled_again(collection, monkeypatch):
    assert compileall.compile_file(str(collection), quiet=1)
    monkeypatch.setattr(_collection_finder, "compile", _never_compile, raising=False)
    from ansible_collections.ns.coll.plugins.module_utils import answer

    assert answer.ANSWER == 42 and answer.__file__ == str(collection)


def test_a_collections_module_edited_after_its_bytecode_is_imported_as_edited(collection):
    assert compileall.compile_file(str(collection), quiet=1)
    collection.write_text("ANSWER = 43  # edited\n")
    os.utime(collection, (1, 1))  # not the mtime the bytecode was checked against
    from ansible_collections.ns.coll.plugins.module_utils import answer

    assert answer.ANSWER == 43


def test_the_pipeline_runs_slurm_multi_playbook_and_it_is_ansible_playbook(tmp_path):
    found = find_ansible_playbook()
    assert found.name == "slurm-multi-playbook" and found.parent == Path(sys.executable).parent
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - debug: {msg: \"{{ 'x' | regex_replace('x', 'ran through ' + ansible_version.string) }}\"}\n"
    )
    ran = subprocess.run(
        [str(found), "-i", "localhost,", "-c", "local", str(play)],
        cwd=ROOT,
        env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), ANSIBLE_CONFIG=str(ROOT / "ansible.cfg")),
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"ran through {ansible.release.__version__}" in ran.stdout
    assert list((tmp_path / "cache" / "slurm-multi" / playbook.CACHE_NAME).glob("*.marshal"))
