"""The user's routing and template caches (slurm_multi/speedup/playbook.py and preload.py) are used
only where no other user can swap them, and read by descriptor: a dir checked is the dir read
(safe_files.open_private_dir). Acted by real local users (tests/support/users/local_users.py): USER's playbooks keep
their caches, HOSTILE owns or may write a dir above them."""

import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_user, run_as, setpriv_argv, system_python

ROOT = Path(__file__).resolve().parents[3]
# What USER's Python imports: the checkout, its collection (module_utils), and for Ansible the venv's packages
# (the venv's own python links into /root, which USER cannot enter).
CHECKOUT_PATH = f"{ROOT}:{ROOT / 'collections'}"
WITH_ANSIBLE_PATH = f"{CHECKOUT_PATH}:{sysconfig.get_paths()['purelib']}"

# USER's playbook parsing a routing file: kept in the cache when the cache is USER's alone.
ROUTING = """
from slurm_multi.speedup import playbook
print(playbook.kept_routing(lambda data, content_id: {"plugin_routing": {}})(b"plugin_routing: {}\\n", None))
"""

# USER's playbook loading its compiled templates, as the callback does on load. Right after the key's dir is
# checked, it says so and waits: the test swaps the dir then, the worst moment a swap could come.
TEMPLATES_CHECKED_THEN_SWAPPED = """
import json, sys
from slurm_multi.speedup import preload as preload_plugins

check = preload_plugins.open_private_dir

def check_then_wait_for_the_swap(path, dir_fd=None):
    opened = check(path, dir_fd=dir_fd)
    if dir_fd is not None:  # the key's dir, below the cache's
        print(preload_plugins.templates_key(), flush=True)
        sys.stdin.readline()
    return opened

preload_plugins.open_private_dir = check_then_wait_for_the_swap
kept = preload_plugins.kept_key_dir("templates", preload_plugins.templates_key())
codes = preload_plugins.CompiledTemplates(kept).codes
print(json.dumps(sorted(code.co_filename for code in codes.values())), flush=True)
"""

# HOSTILE's code, as a compiled template would be kept: marshal'd, run when a template of its key renders.
PLANTED_CODE = """
import marshal, sys
with open(sys.argv[1], "wb") as planted:
    marshal.dump(compile("open('/tmp/owned-by-hostile', 'w')", "<planted by hostile>", "exec"), planted)
"""


@pytest.fixture
def users():
    ensure_user(USER)
    ensure_user(HOSTILE)
    if sys.version_info[:2] != tuple(int(part) for part in _system_python_version().split(".")[:2]):
        pytest.skip("the users' Python must be the venv's version to import its packages")


def _system_python_version():
    return subprocess.run(
        [system_python(), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def shared_base():
    """A dir under /tmp every user can enter (root's, 0755), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-cache-test-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _chown(path, user, group=None):
    shutil.chown(path, user, group or user)


def _routing_as_user(cache_home):
    ran = run_as(
        USER, ["env", f"XDG_CACHE_HOME={cache_home}", f"PYTHONPATH={CHECKOUT_PATH}", system_python(), "-c", ROUTING]
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip() == "{'plugin_routing': {}}"
    return sorted((Path(cache_home) / "slurm-multi" / "routing").glob("*.marshal"))


def _dir_above_owned_by_hostile(base):
    above = base / "hostile's"
    above.mkdir(mode=0o755)
    _chown(above, HOSTILE)
    cache_home = above / "cache"  # USER's, but in a dir HOSTILE may rename in
    cache_home.mkdir(mode=0o700)
    _chown(cache_home, USER)
    return cache_home


def _team_writable_dir_above_without_sticky(base):
    above = base / "team"
    above.mkdir()
    above.chmod(0o2775)  # a teammate may rename what is in it
    _chown(above, USER, TEAM)
    return above


def _dir_planted_by_hostile_in_a_sticky_dir(base):
    sticky = base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    planted = sticky / "cache"
    run_as(HOSTILE, ["mkdir", "-m", "0777", str(planted)], check=True)
    return planted


def _link_planted_by_hostile_in_a_sticky_dir(base):
    sticky = base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    run_as(HOSTILE, ["mkdir", "-m", "0777", str(sticky / "hostile's")], check=True)
    run_as(HOSTILE, ["ln", "-s", str(sticky / "hostile's"), str(sticky / "cache")], check=True)
    return sticky / "cache"


def _users_link_to_a_dir_another_user_owns(base):
    sticky = base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    run_as(HOSTILE, ["mkdir", "-m", "0777", str(sticky / "hostile's")], check=True)
    run_as(USER, ["ln", "-s", str(sticky / "hostile's"), str(sticky / "cache")], check=True)
    return sticky / "cache"


@pytest.mark.parametrize(
    "cache_home",
    [
        _dir_above_owned_by_hostile,
        _team_writable_dir_above_without_sticky,
        _dir_planted_by_hostile_in_a_sticky_dir,
        _link_planted_by_hostile_in_a_sticky_dir,
        _users_link_to_a_dir_another_user_owns,
    ],
    ids=[
        "dir-above-owned-by-another-user",
        "group-writable-dir-above-without-sticky",
        "planted-in-a-sticky-dir",
        "link-planted-in-a-sticky-dir",
        "users-link-to-a-dir-another-user-owns",
    ],
)
def test_a_cache_another_user_could_swap_from_above_is_not_used(users, shared_base, cache_home):
    assert _routing_as_user(cache_home(shared_base)) == []


def test_a_cache_of_the_users_own_in_tmp_is_used(users):
    cache_home = Path("/tmp") / f"slurm-multi-cache-test-{secrets.token_hex(6)}"  # made by USER: sticky /tmp's entry
    try:
        assert len(_routing_as_user(cache_home)) == 1
    finally:
        shutil.rmtree(cache_home, ignore_errors=True)


def test_a_cache_reached_through_the_users_own_link_is_used(users, shared_base):
    # A home or ~/.cache on other storage, by a link of the user's own (here in a sticky dir, as /tmp is).
    sticky = shared_base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    elsewhere = shared_base / "scratch"
    elsewhere.mkdir(mode=0o700)
    _chown(elsewhere, USER)
    run_as(USER, ["ln", "-s", str(elsewhere), str(sticky / "cache")], check=True)
    assert len(_routing_as_user(sticky / "cache")) == 1
    assert len(list((elsewhere / "slurm-multi" / "routing").glob("*.marshal"))) == 1


def test_a_template_cache_swapped_after_its_check_is_not_read(users, shared_base):
    cache_home = shared_base / "users-cache"
    cache_home.mkdir(mode=0o700)
    _chown(cache_home, USER)
    hostiles = shared_base / "hostile's"
    hostiles.mkdir()
    _chown(hostiles, HOSTILE)
    planted = hostiles / "planted"
    run_as(HOSTILE, ["mkdir", "-m", "0755", str(planted)], check=True)
    run_as(HOSTILE, [system_python(), "-c", PLANTED_CODE, str(planted / ("0" * 64))], check=True)
    loading = subprocess.Popen(
        setpriv_argv(
            USER,
            ["env", f"XDG_CACHE_HOME={cache_home}", f"PYTHONPATH={WITH_ANSIBLE_PATH}", system_python()]
            + ["-c", TEMPLATES_CHECKED_THEN_SWAPPED],
        ),
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        key = loading.stdout.readline().strip()
        assert key, loading.stderr.read()
        checked = cache_home / "slurm-multi" / "templates" / key
        # Checked as USER's own: now another dir, with HOSTILE's code in it, takes its name.
        os.rename(checked, checked.with_name(f"{key}-aside"))
        os.rename(planted, checked)
        out, err = loading.communicate("swapped\n", timeout=120)
    finally:
        if loading.poll() is None:
            loading.kill()
            loading.wait()
    assert loading.returncode == 0, err
    assert json.loads(out) == []  # nothing of HOSTILE's: the dir read is the one checked, still empty
