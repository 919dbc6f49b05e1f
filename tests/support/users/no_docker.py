"""The user of a site without Docker (local_users.NODOCKER): made here, and proven unable to reach any Docker daemon.

Most SLURM sites give their users no Docker: the docker group is root on the node. The no-Docker runtime's lab tests
submit as NODOCKER, who is in no docker group and runs with ``no_docker_path()``: the user's venv, then mirrors of
the system's bin folders holding a symlink to every command but Docker's, as a site's symlink farm (Spack views,
environment modules) holds its commands (Debian's /bin is /usr/bin, which holds `docker`, so a PATH of the system
folders cannot leave it out). A command found there may be a symlink: whoever runs it by its path through another
interpreter must resolve it first. ``assert_no_docker_reachable`` proves, as that user, that no Docker
daemon can have been contacted: every lab node's socket refuses to open and no docker command is found. A job that
succeeds under those conditions used no daemon.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from pathlib import Path

from slurm_multi.lab.cluster import DOCKER_GROUP, MAX_NODES, LabNode
from tests.support.users.local_users import NODOCKER, TEAM, ensure_user, run_as

# Root-made mirrors of the system's command folders, readable by every user; made once per machine, refreshed when
# the system gains a command.
MIRROR = Path("/var/tmp/slurm-multi-no-docker-path")
SYSTEM_BIN_DIRS = ("/usr/local/bin", "/usr/bin", "/usr/local/sbin", "/usr/sbin")
# Docker's own commands: the CLI, the daemon, its proxy and init, its credential helpers.
DOCKER_COMMAND_PREFIX = "docker"
# The sockets a user could reach a daemon by: the machine's default one and each lab node's.
DEFAULT_DOCKER_SOCKET = Path("/run/docker.sock")


def ensure_nodocker_user() -> pwd.struct_passwd:
    """NODOCKER (made if missing), a member of the team and of no docker group: an earlier grant is taken back."""
    user = ensure_user(NODOCKER, groups=(TEAM,))
    try:
        members = grp.getgrnam(DOCKER_GROUP).gr_mem
    except KeyError:
        return user
    if NODOCKER in members:
        subprocess.run(["gpasswd", "--delete", NODOCKER, DOCKER_GROUP], check=True, capture_output=True)
    return user


def _mirror(source: str) -> Path:
    """MIRROR/<folder>: a symlink to each command of `source` but Docker's."""
    target = MIRROR / source.strip("/").replace("/", "-")
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o755)
    wanted = {
        entry.name
        for entry in os.scandir(source)
        if not entry.name.startswith(DOCKER_COMMAND_PREFIX) and not entry.is_dir(follow_symlinks=True)
    }
    present = {entry.name for entry in os.scandir(target)}
    for name in present - wanted:
        (target / name).unlink()
    for name in wanted - present:
        (target / name).symlink_to(Path(source) / name)
    return target


def no_docker_path(venv: Path) -> str:
    """A PATH for NODOCKER: `venv`'s bin, then the system's commands without Docker's."""
    MIRROR.mkdir(parents=True, exist_ok=True)
    MIRROR.chmod(0o755)
    folders = [str(_mirror(source)) for source in SYSTEM_BIN_DIRS if os.path.isdir(source)]
    return ":".join([str(venv / "bin"), *folders])


def docker_sockets() -> list[Path]:
    """The machine's default Docker socket and every lab node's that exists."""
    sockets = [DEFAULT_DOCKER_SOCKET] + [LabNode(index).docker_socket for index in range(1, MAX_NODES + 1)]
    return [socket for socket in sockets if socket.exists()]


# Run as the user: connect to each socket; print the ones that opened, and whether `docker` is found on PATH.
_PROBE = r"""
import shutil, socket, sys
opened = []
for path in sys.argv[1:]:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(path)
        except OSError:
            continue
        opened.append(path)
print("opened:", " ".join(opened))
print("docker:", shutil.which("docker") or shutil.which("dockerd") or "")
"""


def assert_no_docker_reachable(path: str, user: str = NODOCKER) -> None:
    """As `user` with `path` as PATH: no Docker socket opens (lab nodes' and the machine's) and no docker command
    is found; AssertionError naming what was reachable otherwise."""
    sockets = docker_sockets()
    assert sockets, "no Docker socket found to prove unreachable: is the lab up?"
    probe = run_as(user, ["env", f"PATH={path}", "/usr/bin/python3", "-c", _PROBE, *map(str, sockets)])
    assert probe.returncode == 0, probe.stderr
    lines = dict(line.split(":", 1) for line in probe.stdout.splitlines())
    assert lines["opened"].strip() == "", f"{user} can open Docker sockets: {lines['opened'].strip()}"
    assert lines["docker"].strip() == "", f"{user} finds a docker command on its PATH: {lines['docker'].strip()}"
