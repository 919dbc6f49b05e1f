"""Ordinary local users for the tests of shared places (/dev/shm, /tmp, a team's results dir, caches).

A real cluster's users are not root, and the suite runs as root: a test of a shared place makes real users here
(`useradd`, once per machine) and acts as them with `setpriv --reuid --regid --init-groups`. USER is the job's
ordinary user, HOSTILE another user of the same node who plants things where USER's job will look.

Both get a home of their own (0700, as on a cluster) and no sudo. They run Python as /usr/bin/python3 (Debian's):
the suite's venv links into /root, which they cannot enter.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess

import pytest

USER = "slurmmulti-user"
HOSTILE = "slurmmulti-hostile"
# The user of a site with no Docker for its users: in no docker group, no docker CLI on its PATH (the no-Docker
# runtime's tests submit as this user; tests/support/users/no_docker.py proves no daemon was contacted).
NODOCKER = "slurmmulti-nodocker"
# A team both belong to, for group-shared dirs.
TEAM = "slurmmulti-team"
# The Python an ordinary user can run (its venv must not link into /root).
SYSTEM_PYTHON = "/usr/bin/python3"


def ensure_group(name: str) -> grp.struct_group:
    try:
        return grp.getgrnam(name)
    except KeyError:
        subprocess.run(["groupadd", name], check=True)
        return grp.getgrnam(name)


def ensure_user(name: str, groups: tuple[str, ...] = (TEAM,)) -> pwd.struct_passwd:
    """The local user `name` (made if missing, with a 0700 home), a member of `groups`; skips when not root."""
    if os.geteuid() != 0:
        pytest.skip("making a second local user needs root")
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs useradd and setpriv (Debian's passwd and util-linux)")
    for group in groups:
        ensure_group(group)
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        argv = ["useradd", "--create-home", "--shell", "/bin/bash", name]
        if groups:
            argv[1:1] = ["--groups", ",".join(groups)]
        subprocess.run(argv, check=True)
        user = pwd.getpwnam(name)
    for group in groups:
        if name not in grp.getgrnam(group).gr_mem:
            subprocess.run(["usermod", "--append", "--groups", group, name], check=True)
    os.chmod(user.pw_dir, 0o700)
    return user


def setpriv_argv(name: str, argv: list[str]) -> list[str]:
    """`argv` run as `name`: its uid, gid and groups, its own HOME and USER, no root left."""
    user = pwd.getpwnam(name)
    return [
        "setpriv",
        "--reuid",
        name,
        "--regid",
        str(user.pw_gid),
        "--init-groups",
        "env",
        f"HOME={user.pw_dir}",
        f"USER={name}",
        f"LOGNAME={name}",
        *argv,
    ]


def run_as(name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`argv` run to its end as `name` (text output captured unless the caller says otherwise)."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 120)
    kwargs.setdefault("cwd", "/")
    return subprocess.run(setpriv_argv(name, argv), **kwargs)


def start_as(name: str, argv: list[str], **kwargs) -> subprocess.Popen:
    """`argv` started as `name`; the caller stops it by its pid."""
    kwargs.setdefault("cwd", "/")
    return subprocess.Popen(setpriv_argv(name, argv), **kwargs)


def system_python() -> str:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON}, a Python every user can run")
    return SYSTEM_PYTHON
