"""`slurm-multi submit` checks the shared dirs a job will write before anything is written or queued
(slurm_multi/submission/shared_dirs.py), run by a real user of a team (tests/support/users/local_users.py).

Each submission runs in a fresh HOME of the user's own: submit writes the job's private dir there before sbatch, so
an empty HOME afterwards means nothing reached sbatch. SLURM_CONF is empty, so a submission that got past the checks
could queue nothing on the lab either.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.users.local_users import TEAM, USER, ensure_group, ensure_user
from tests.support.users.user_python import slurm_multi_as

SUBMIT = ["submit", "-N", "2", "--tags", "dummy"]


@pytest.fixture
def shared_place():
    """(base, home): a dir every user can reach, and in it a fresh, empty HOME of USER's."""
    user = ensure_user(USER)
    base = Path(tempfile.mkdtemp(prefix="slurm-multi-submit-"))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir(mode=0o700)
    (base / "site.yml").touch(mode=0o644)  # an empty site file (the lab's sets image_cache_dir), root's
    os.chown(home, user.pw_uid, user.pw_gid)
    yield base, home
    shutil.rmtree(base)


def _team_dir(path: Path, mode: int) -> Path:
    path.mkdir()
    os.chown(path, 0, ensure_group(TEAM).gr_gid)
    path.chmod(mode)
    return path


# A SLURM config sbatch refuses at once.
_ENV = {"SLURM_CONF": "/dev/null"}


def _submit(home: Path, *args: str):
    # The shared place's empty site file: no settings of the lab's.
    env = dict(_ENV, SLURM_MULTI_SITE_CONFIG=str(home.parent / "site.yml"))
    done = slurm_multi_as(USER, [*SUBMIT, *args], home=str(home), env=env)
    return done, done.stdout + done.stderr


def test_submit_refuses_a_team_results_dir_without_the_sticky_bit_and_queues_nothing(shared_place):
    base, home = shared_place
    results = _team_dir(base / "results", 0o2775)

    done, said = _submit(home, "--results-dir", str(results))

    assert done.returncode == 2, said
    assert f"the results directory {results} is writable by its group {TEAM}" in said, said
    assert f"chmod 3775 {results}" in said and "Nothing was submitted" in said
    assert "Submitted job" not in said and list(home.iterdir()) == []


def test_submit_refuses_a_records_dir_without_the_sticky_bit_in_a_sticky_team_dir(shared_place):
    base, home = shared_place
    results = _team_dir(base / "results", 0o3775)
    records = _team_dir(results / "records", 0o2775)  # as versions before the sticky rule made it

    done, said = _submit(home, "--results-dir", str(results))

    assert done.returncode == 2, said
    assert f"the records directory {records} is writable by its group {TEAM}" in said, said
    assert f"chmod 3775 {records}" in said and list(home.iterdir()) == []


def test_submit_refuses_an_image_cache_its_group_may_write(shared_place):
    base, home = shared_place
    user = ensure_user(USER)
    results = _team_dir(base / "results", 0o3775)
    cache = results / f"image-cache-{USER}"  # the default, image-cache-%u
    cache.mkdir(mode=0o770)
    os.chown(cache, user.pw_uid, user.pw_gid)
    cache.chmod(0o770)

    done, said = _submit(home, "--results-dir", str(results))

    assert done.returncode == 2, said
    assert f"image cache directory {cache} is writable by other users" in said, said
    assert f"chmod go-w {cache}" in said and list(home.iterdir()) == []


def test_a_dry_run_as_a_teammate_accepts_the_sticky_team_dir_the_docs_recommend(shared_place):
    base, home = shared_place
    results = _team_dir(base / "results", 0o3775)
    _team_dir(results / "records", 0o3775)

    done, said = _submit(home, "--dry-run", "--results-dir", str(results))

    assert done.returncode == 0, said
    assert "# Dry run: nothing written, nothing submitted" in said


@pytest.mark.parametrize("missing", [False, True], ids=["existing", "to-be-made"])
def test_submit_refuses_a_results_dir_the_user_cannot_write_and_queues_nothing(shared_place, missing):
    base, home = shared_place
    locked = base / "locked"
    locked.mkdir(mode=0o755)  # root's, not writable by the user: neither it nor a dir in it can be written
    results = locked / "results" if missing else locked

    done, said = _submit(home, "--results-dir", str(results))

    assert done.returncode == 2, said
    assert f"the results directory {results}" in said and f"is not writable by you ({USER})" in said, said
    assert ("cannot be made: its parent" in said) == missing, said
    assert "Choose a results_dir" in said and list(home.iterdir()) == []


def test_submit_refuses_an_image_cache_the_user_cannot_make(shared_place):
    base, home = shared_place
    locked = base / "locked"
    locked.mkdir(mode=0o755)
    results = _team_dir(base / "results", 0o3775)

    done, said = _submit(home, "--results-dir", str(results), "-e", f"image_cache_dir={locked}/cache-%u")

    assert done.returncode == 2, said
    assert f"the image cache directory {locked}/cache-{USER} cannot be made: its parent {locked}" in said, said
    assert "image_cache_dir" in said and list(home.iterdir()) == []
