"""Who may read a rank's stacks, and what a user who may not is told (module_utils/run/hang/stacks.py TRACE_REFUSED,
docs/hangs.md "Stacks as an ordinary user"): ways that are safe, never a ptrace capability on py-spy.

Real processes and users (tests/support/users/local_users.py): USER's py-spy against a root process (a rootful Docker's
rank) and against USER's own process in a user namespace of theirs (a rootless container's rank). This machine's
kernel has no Yama; under ptrace_scope 1 or 2 the second read passes by the capability USER holds in that namespace
(the docs say why)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.stacks import TRACE_REFUSED, pyspy_error
from tests.support.users.local_users import USER, ensure_user, run_as, start_as, system_python

ROOT = Path(__file__).resolve().parents[5]
PYSPY = Path(sys.executable).parent / "py-spy"  # static, 0755: any user may run it
RANK = "import sys, time\nprint('ready', flush=True)\ndef all_reduce():\n    time.sleep(120)\nall_reduce()\n"


def _started(process):
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # its first frame entered
    return process


def _stop(process):
    process.kill()
    process.wait()


def _dump_as_user(pid):
    return run_as(USER, [str(PYSPY), "dump", "--pid", str(pid)], timeout=60)


@pytest.fixture
def user():
    ensure_user(USER)
    if not PYSPY.exists():
        pytest.skip("needs the venv's py-spy")


def test_a_rank_of_another_user_refused_to_the_users_py_spy_is_told_the_safe_ways(user):
    rank = _started(subprocess.Popen([system_python(), "-c", RANK], stdout=subprocess.PIPE, text=True))  # root's
    try:
        dumped = _dump_as_user(rank.pid)
    finally:
        _stop(rank)
    assert dumped.returncode != 0
    said = pyspy_error(dumped.stderr or dumped.stdout, rank.pid)
    assert said == f"py-spy may not read process {rank.pid}: {TRACE_REFUSED}"
    assert "as root" in said and "rootless Docker or Podman" in said
    assert "setcap" not in said and "+ep" not in said


def test_a_rank_in_the_users_own_user_namespace_is_read_by_the_users_py_spy(user):
    # As a rootless runtime runs it: root inside a user namespace the user made, the user outside.
    rank = start_as(
        USER,
        ["unshare", "--user", "--map-root-user", system_python(), "-c", RANK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if rank.stdout.readline().strip() != "ready":
            pytest.skip(f"no user namespace for an ordinary user here: {rank.stderr.read()}")
        time.sleep(0.2)
        dumped = _dump_as_user(rank.pid)
    finally:
        _stop(rank)
    assert dumped.returncode == 0, dumped.stderr
    assert "all_reduce" in dumped.stdout


def test_the_docs_give_the_messages_advice_and_never_advise_a_ptrace_capability():
    hangs = (ROOT / "docs" / "hangs.md").read_text()
    assert " ".join(TRACE_REFUSED.split()) in " ".join(hangs.split())
    capability_lines = [line for line in hangs.splitlines() if "setcap" in line or "cap_sys_ptrace" in line]
    assert capability_lines and all(line.startswith("* **Not a ptrace capability") for line in capability_lines)
