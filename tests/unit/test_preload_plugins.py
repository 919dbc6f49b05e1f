"""The controller's per-run work done once (plugins/callback/preload_plugins.py): module payloads kept between runs
under a key of everything they are built from, in the user's own private cache only."""

import os
import shutil
import subprocess
import sys

from plugins.callback.preload_plugins import own_private_dir, payload_key
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


def test_a_change_to_any_module_or_module_utils_file_is_a_new_key(tmp_path):
    for source in ("library", "module_utils"):
        shutil.copytree(ROOT / source, tmp_path / source)
    before = payload_key(str(tmp_path))
    assert payload_key(str(tmp_path)) == before
    with open(tmp_path / "module_utils" / "job_layout.py", "a") as handle:
        handle.write("\n# changed\n")
    assert payload_key(str(tmp_path)) != before


def test_payloads_are_kept_only_in_a_private_dir_of_the_users_own(tmp_path):
    assert own_private_dir(str(tmp_path / "new")) == str(tmp_path / "new")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant a payload (a pickle) there
    assert own_private_dir(str(shared)) is None
    link = tmp_path / "link"
    os.symlink(tmp_path / "new", link)
    assert own_private_dir(str(link)) is None
