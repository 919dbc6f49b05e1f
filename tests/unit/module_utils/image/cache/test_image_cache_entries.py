"""The image cache directory checked and then used through one descriptor (module_utils/image/cache/entries.py),
tried by two real users (tests/support/users/local_users.py).

A cache may sit in a dir a teammate can rename in (a team's dir without the sticky bit, a shared scratch): HOSTILE
renames USER's checked cache dir aside between the check and the use and puts a link to a dir of its own (holding
its own marker) in its place. USER's reads and commits still reach the dir that was checked.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_group, ensure_user, run_as
from tests.support.users.user_python import run_python_as, start_python_as

OURS, THEIRS, NEW = "a" * 64, "b" * 64, "c" * 64
KEY = "1" * 64
KEY_WRITTEN = "2" * 64

# USER's publish and load steps, stopped after the check until the test has swapped the dir.
_CHECK_THEN_USE = """
import json, os, sys
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
root, key, key_written, image_id = sys.argv[1:]
cache = CacheDirectory(root)
assert cache.open_root(create=False)
print("checked", flush=True)
sys.stdin.readline()
marker = cache.read_marker(key)
temp = cache.temp_path(key_written, "json")
with cache.create_file(temp) as out:
    out.write(json.dumps({"image_id": image_id, "size": 1, "sha256": "0" * 64}).encode())
committed = cache.commit(temp, cache.marker_path(key_written))
print(json.dumps({"read": marker["image_id"], "committed": committed}), flush=True)
"""

_CHECK = """
import sys
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    ImageCacheError, check_cache_dir,
)
try:
    check_cache_dir(sys.argv[1], create=False)
except ImageCacheError as exc:
    sys.exit(str(exc))
"""


def _marker(path: Path, image_id: str, owner) -> None:
    path.write_text(json.dumps({"image_id": image_id, "size": 1, "sha256": "0" * 64}))
    os.chown(path, owner.pw_uid, owner.pw_gid)
    path.chmod(0o600)


@pytest.fixture
def shared_parent():
    """(parent, USER's cache in it, HOSTILE's own dir): a parent the team may rename in (2775, no sticky bit)."""
    user, hostile = ensure_user(USER), ensure_user(HOSTILE)
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-cache-swap-"))
    base.chmod(0o755)
    parent = base / "shared"
    parent.mkdir()
    os.chown(parent, 0, ensure_group(TEAM).gr_gid)
    parent.chmod(0o2775)
    cache = parent / f"image-cache-{USER}"
    cache.mkdir(mode=0o700)
    os.chown(cache, user.pw_uid, user.pw_gid)
    _marker(cache / f"{KEY}.json", f"sha256:{OURS}", user)
    theirs = base / "hostile"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, hostile.pw_uid, hostile.pw_gid)
    _marker(theirs / f"{KEY}.json", f"sha256:{THEIRS}", hostile)
    (theirs / f"{KEY}.json").chmod(0o644)
    yield parent, cache, theirs
    shutil.rmtree(base)


def test_a_cache_dir_swapped_after_its_check_is_not_used_the_checked_one_is(shared_parent):
    parent, cache, theirs = shared_parent
    user_step = start_python_as(USER, _CHECK_THEN_USE, str(cache), KEY, KEY_WRITTEN, f"sha256:{NEW}", home="/")
    try:
        assert user_step.stdout.readline() == "checked\n", user_step.stderr.read()
        aside = parent / "moved-aside"
        swap = f"import os; os.rename({str(cache)!r}, {str(aside)!r}); os.symlink({str(theirs)!r}, {str(cache)!r})"
        swapped = run_as(HOSTILE, ["/usr/bin/python3", "-c", swap])
        assert swapped.returncode == 0, swapped.stderr
        out, err = user_step.communicate("go\n", timeout=60)
    finally:
        if user_step.poll() is None:
            user_step.kill()
            user_step.wait()

    assert user_step.returncode == 0, err
    assert json.loads(out) == {"read": f"sha256:{OURS}", "committed": True}
    assert json.loads((aside / f"{KEY_WRITTEN}.json").read_text())["image_id"] == f"sha256:{NEW}"
    assert not (theirs / f"{KEY_WRITTEN}.json").exists() and sorted(os.listdir(theirs)) == [f"{KEY}.json"]


def test_a_link_another_user_planted_at_the_cache_path_is_refused_wherever_it_points(shared_parent):
    parent, cache, _ = shared_parent
    planted = parent / "planted-cache"
    # A link to the user's own, checked-fine cache dir: only who made the link is wrong.
    made = run_as(HOSTILE, ["ln", "-s", str(cache), str(planted)])
    assert made.returncode == 0, made.stderr

    checked = run_python_as(USER, _CHECK, str(planted), home="/")

    assert checked.returncode != 0
    assert f"image cache directory {planted} is a symbolic link owned by {HOSTILE}" in checked.stderr, checked.stderr
