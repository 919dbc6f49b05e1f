"""The controller's per-run work done once (slurm_multi/speedup/preload.py, the preload_plugins callback): module
payloads and the templates' compiled code kept between runs under a key of everything they are built from, in the
user's own private cache only."""

import base64
import io
import marshal
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

from slurm_multi.speedup.preload import (
    open_private_dir,
    payload_key,
    prune_unused_keys,
    templates_key,
    with_bytecode,
)
from tests.support.ansible import BIN, ROOT, ansible_env

PLAY = "- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.command: 'true'\n"


def _playbook(tmp_path, cache_home):
    (tmp_path / "play.yml").write_text(PLAY)
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(tmp_path / "play.yml")]
        + ["-e", f"ansible_python_interpreter={sys.executable}"],
        cwd=ROOT,
        env=dict(ansible_env(), XDG_CACHE_HOME=str(cache_home)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_next_playbook_takes_the_payloads_the_last_one_built(tmp_path):
    cache_home = tmp_path / "cache"
    first = _playbook(tmp_path, cache_home)
    assert first.returncode == 0, first.stdout[-3000:]
    (kept,) = (cache_home / "slurm-multi" / "ansiballz").iterdir()
    assert kept.name == payload_key() and oct(kept.stat().st_mode & 0o777) == "0o700"
    (command,) = [path for path in kept.iterdir() if "command" in path.name]
    # Taken, not rebuilt: a payload spoilt in the cache spoils the next run.
    command.write_bytes(b"not a payload")
    assert _playbook(tmp_path, cache_home).returncode != 0
    command.unlink()
    assert _playbook(tmp_path, cache_home).returncode == 0


# Rendered by the worker of a task: its code compiled there, kept for the next playbook.
TEMPLATE = "{{ [1, 2] | sum }}"
# The same sum in a template whose first line gives Jinja other delimiters: compiled as before, never kept.
OVERRIDDEN = "#jinja2:variable_start_string:'[%', variable_end_string:'%]'\n[% [1, 2] | sum %]"
TEMPLATE_PLAY = f"""- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "sum={TEMPLATE}"
    - ansible.builtin.debug:
        msg: {OVERRIDDEN!r}
"""


def _template_playbook(tmp_path, cache_home):
    (tmp_path / "templates.yml").write_text(TEMPLATE_PLAY)
    ran = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(tmp_path / "templates.yml")],
        cwd=ROOT,
        env=dict(ansible_env(), XDG_CACHE_HOME=str(cache_home)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return ran.stdout


def test_the_next_playbook_takes_a_templates_code_the_last_one_compiled(tmp_path):
    cache_home = tmp_path / "cache"
    assert "sum=3" in _template_playbook(tmp_path, cache_home)
    kept = cache_home / "slurm-multi" / "templates" / templates_key()
    assert oct(kept.stat().st_mode & 0o777) == "0o700"
    # One template kept: the overridden one is compiled as before (its settings are not the default ones).
    (code,) = kept.iterdir()
    # Taken, not compiled again: the code of another sum under this template's key is what the next run renders.
    from ansible._internal._templating._jinja_bits import AnsibleEnvironment

    code.write_bytes(marshal.dumps(AnsibleEnvironment().compile("sum={{ [3, 4] | sum }}")))
    assert "sum=7" in _template_playbook(tmp_path, cache_home)
    # Unreadable: compiled again, and kept again.
    code.write_bytes(b"not code")
    output = _template_playbook(tmp_path, cache_home)
    assert "sum=3" in output and marshal.loads(code.read_bytes()).co_filename == "<template>"
    # The overridden template rendered with its own delimiters.
    assert "msg: 3" in output or 'msg": 3' in output, output


def test_a_change_to_any_module_or_module_utils_file_is_a_new_key(tmp_path):
    for source in ("library", "module_utils"):
        shutil.copytree(ROOT / source, tmp_path / source)
    before = payload_key(str(tmp_path))
    assert payload_key(str(tmp_path)) == before
    with open(tmp_path / "module_utils" / "job" / "layout.py", "a") as handle:
        handle.write("\n# changed\n")
    assert payload_key(str(tmp_path)) != before


def test_a_change_to_a_module_of_a_built_collection_is_a_new_key(tmp_path):
    # The built collection (slurm_multi/collection.py) holds library/ as plugins/modules, module_utils/ beside it.
    for source, target in (("library", "plugins/modules"), ("module_utils", "plugins/module_utils")):
        shutil.copytree(ROOT / source, tmp_path / target)
    before = payload_key(str(tmp_path))
    with open(tmp_path / "plugins" / "modules" / "run_model.py", "a") as handle:
        handle.write("\n# changed\n")
    assert payload_key(str(tmp_path)) != before


def _is_private_dir(path):
    """Whether open_private_dir takes ``path``, its descriptor closed again."""
    fd = open_private_dir(str(path))
    if fd is None:
        return False
    os.close(fd)
    return True


def test_payloads_are_kept_only_in_a_private_dir_of_the_users_own(tmp_path):
    assert _is_private_dir(tmp_path / "new") and oct((tmp_path / "new").stat().st_mode & 0o777) == "0o700"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant a payload (a pickle) there
    assert not _is_private_dir(shared)


def _import_from(zip_path, module):
    code = (
        f"import sys; sys.path.insert(0, {str(zip_path)!r}); import {module} as m; print(m.__file__, vars(m).get('X'))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_kept_payloads_carry_bytecode_that_the_same_python_imports(tmp_path):
    cache_home = tmp_path / "cache"
    assert _playbook(tmp_path, cache_home).returncode == 0
    (kept,) = (cache_home / "slurm-multi" / "ansiballz" / payload_key()).glob("*command*")
    (tmp_path / "payload.zip").write_bytes(base64.b64decode(pickle.loads(kept.read_bytes()).zip_data))
    names = zipfile.ZipFile(tmp_path / "payload.zip").namelist()
    sources = [name for name in names if name.endswith(".py")]
    assert sources and all(f"{name}c" in names for name in sources)
    assert _import_from(tmp_path / "payload.zip", "ansible.module_utils.basic") == [
        f"{tmp_path}/payload.zip/ansible/module_utils/basic.pyc",
        "None",
    ]


def test_bytecode_whose_source_changed_or_of_another_python_is_not_taken(tmp_path):
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w") as archive:
        archive.writestr("stale.py", "X = 1\n")
        archive.writestr("foreign.py", "X = 2\n")
    compiled = zipfile.ZipFile(io.BytesIO(base64.b64decode(with_bytecode(base64.b64encode(plain.getvalue())))))
    with zipfile.ZipFile(tmp_path / "payload.zip", "w") as archive:
        archive.writestr("stale.py", "X = 3\n")
        archive.writestr("stale.pyc", compiled.read("stale.pyc"))  # compiled from X = 1
        archive.writestr("foreign.py", "X = 2\n")
        archive.writestr("foreign.pyc", b"\0\0" + compiled.read("foreign.pyc")[2:])  # another Python's magic
    assert _import_from(tmp_path / "payload.zip", "stale") == [f"{tmp_path}/payload.zip/stale.py", "3"]
    assert _import_from(tmp_path / "payload.zip", "foreign") == [f"{tmp_path}/payload.zip/foreign.py", "2"]


def test_keys_unused_for_a_week_are_pruned_and_the_rest_kept(tmp_path):
    old, recent = tmp_path / "old-key", tmp_path / "recent-key"
    for key in (old, recent):
        key.mkdir()
        (key / "ansible.legacy.node_facts-ZIP_DEFLATED-none").write_bytes(b"payload")
    week_and_a_day = 8 * 86400
    os.utime(old, (os.path.getmtime(old) - week_and_a_day,) * 2)
    cache = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        prune_unused_keys(cache)
    finally:
        os.close(cache)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["recent-key"]
    assert (recent / "ansible.legacy.node_facts-ZIP_DEFLATED-none").read_bytes() == b"payload"
