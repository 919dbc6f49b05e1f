"""The lab's daemon start-up checks and its registry's pid file, on real processes (no lab needed).

The registry tests run a real `docker-registry` with the lab's state dir, /etc/hosts and site config moved into the
test's tmp dir and a free port: the running lab (and its own registry) are never touched. A node's Docker socket is
stood for by a listening socket of the test's own, tried by two ordinary users.
"""

import base64
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slurm_multi.lab import cluster as lab
from slurm_multi.lab.cluster import LabError, _has_exited, _wait_for
from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_user, run_as, system_python


def test_a_running_process_has_not_exited():
    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            assert not _has_exited(proc.pid)
        finally:
            proc.kill()


def test_a_dead_process_has_exited_even_before_it_is_reaped():
    proc = subprocess.Popen(["true"])
    time.sleep(0.5)  # now a zombie: dead, not yet reaped
    assert _has_exited(proc.pid)
    proc.wait()
    assert _has_exited(proc.pid)


def test_waiting_on_a_daemon_that_execs_does_not_take_it_for_dead(tmp_path):
    # A shell that execs another program, as setpriv execs munged: the pid stays, its command line changes.
    ready = tmp_path / "ready"
    with subprocess.Popen(
        [
            "sh",
            "-c",
            f'exec {sys.executable} -c "import pathlib, time; '
            f"time.sleep(0.5); pathlib.Path('{ready}').touch(); time.sleep(30)\"",
        ]
    ) as proc:
        try:
            _wait_for(ready.exists, 20, "the test daemon", tmp_path / "log", proc.pid)
            assert ready.exists(), "the wait returned before the daemon was ready"
            assert not _has_exited(proc.pid), "the daemon that exec'd was taken for dead"
        finally:
            proc.kill()


def test_waiting_on_a_daemon_that_dies_names_it_and_shows_its_log(tmp_path):
    log = tmp_path / "daemon.log"
    log.write_text("fatal: cannot bind port 6817\n")
    with subprocess.Popen(["true"]) as proc:
        with pytest.raises(LabError, match="the test daemon exited while starting(.|\n)*cannot bind port 6817"):
            _wait_for(lambda: False, 20, "the test daemon", log, proc.pid)


# --- the registry ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def lab_dir(tmp_path, monkeypatch):
    """A lab state dir of this test's own, with the registry on a free port; its registry stopped at the end."""
    if os.geteuid() != 0:
        pytest.skip("lab down needs root")
    monkeypatch.setattr(lab, "LAB_DIR", tmp_path / "lab")
    monkeypatch.setattr(lab, "HOSTS_FILE", tmp_path / "hosts")
    monkeypatch.setattr(lab, "SITE_CONFIG", tmp_path / "site.yml")
    monkeypatch.setattr(lab, "REGISTRY_PORT", _free_port())
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    yield lab.LAB_DIR
    lab._stop("registry", "docker-registry")


def test_the_registry_starts_on_loopback_with_its_pid_file_and_storage_in_the_state_dir(lab_dir):
    lab._start_registry(progress=lambda message: None)
    pid = int((lab_dir / "pids" / "registry.pid").read_text())
    assert lab.running_pid("registry", "docker-registry") == pid
    assert lab.registry_answers("127.0.0.1", lab.REGISTRY_PORT)
    config = (lab_dir / "registry" / "config.yml").read_text()
    assert f"addr: 127.0.0.1:{lab.REGISTRY_PORT}" in config
    assert f"rootdirectory: {lab_dir / 'registry' / 'storage'}" in config


def test_starting_the_registry_again_keeps_the_running_one(lab_dir):
    lab._start_registry(progress=lambda message: None)
    first = lab.running_pid("registry", "docker-registry")
    said = []
    lab._start_registry(progress=said.append)
    assert lab.running_pid("registry", "docker-registry") == first
    assert said == []


def test_lab_down_stops_the_registry_by_its_pid_and_removes_the_pid_file(lab_dir):
    lab._start_registry(progress=lambda message: None)
    pid = lab.running_pid("registry", "docker-registry")
    said = []
    lab.down(progress=said.append)
    assert _has_exited(pid)
    assert not (lab_dir / "pids" / "registry.pid").exists()
    assert not lab.registry_answers("127.0.0.1", lab.REGISTRY_PORT)
    assert "registry stopped" in said


def test_a_stale_registry_pid_file_naming_another_program_leaves_that_program_alone(lab_dir):
    with subprocess.Popen(["sleep", "30"]) as other:
        try:
            (lab_dir / "pids").mkdir(parents=True)
            (lab_dir / "pids" / "registry.pid").write_text(f"{other.pid}\n")
            lab.down(progress=lambda message: None)
            assert not _has_exited(other.pid), "lab down killed a process that is not the registry"
            lab._start_registry(progress=lambda message: None)
            assert lab.running_pid("registry", "docker-registry") not in (None, other.pid)
        finally:
            other.kill()


def test_a_taken_registry_port_is_a_clear_error_naming_it(lab_dir):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", lab.REGISTRY_PORT))
        squatter.listen()
        with pytest.raises(LabError, match=rf"port 127.0.0.1:{lab.REGISTRY_PORT} needed by the lab registry is taken"):
            lab._start_registry(progress=lambda message: None)


# --- the registry that asks for a login --------------------------------------------------------------------------


@pytest.fixture
def auth_lab_dir(lab_dir, monkeypatch):
    """`lab_dir` with the registry that needs a login on a free port of its own; stopped at the end."""
    monkeypatch.setattr(lab, "AUTH_REGISTRY_PORT", _free_port())
    yield lab_dir
    lab._stop("auth-registry", str(lab_dir / "auth-registry" / "config.yml"))


def _login_status(password: str) -> int:
    """The HTTP status the registry answers `GET /v2/` with, as the lab user with `password`."""
    token = base64.b64encode(f"{lab.AUTH_REGISTRY_USER}:{password}".encode()).decode()
    request = urllib.request.Request(
        f"http://{lab.auth_registry_url()}/v2/", headers={"Authorization": f"Basic {token}"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_registry_with_a_login_starts_with_its_pid_file_and_a_0600_mad_credential_file(auth_lab_dir):
    lab._start_registry(progress=lambda message: None, login=True)
    pid = int((auth_lab_dir / "pids" / "auth-registry.pid").read_text())
    assert lab.daemon_states(1)["auth-registry"] == pid
    credentials = lab.auth_registry_credentials_file()
    assert credentials.parent == auth_lab_dir / "auth-registry"
    assert (
        credentials.stat().st_mode & 0o777 == 0o600
        and (auth_lab_dir / "auth-registry" / "htpasswd").stat().st_mode & 0o077 == 0
    )
    entry = json.loads(credentials.read_text())[lab.auth_registry_url()]
    assert entry["username"] == lab.AUTH_REGISTRY_USER and len(entry["password"]) >= 24
    assert _login_status(entry["password"]) == 200
    assert _login_status(entry["password"] + "x") == 401
    assert lab.registry_answers("127.0.0.1", lab.AUTH_REGISTRY_PORT, login=True)
    assert not lab.registry_answers("127.0.0.1", lab.AUTH_REGISTRY_PORT)  # no anonymous access


def test_the_registry_with_a_login_keeps_its_password_across_restarts(auth_lab_dir):
    lab._start_registry(progress=lambda message: None, login=True)
    first = lab.auth_registry_credentials_file().read_text()
    lab._stop("auth-registry", str(auth_lab_dir / "auth-registry" / "config.yml"))
    deadline = time.monotonic() + 10  # the stopped registry's socket may linger a moment
    while lab._port_in_use("127.0.0.1", lab.AUTH_REGISTRY_PORT) and time.monotonic() < deadline:
        time.sleep(0.1)
    lab._start_registry(progress=lambda message: None, login=True)
    assert lab.auth_registry_credentials_file().read_text() == first


def test_lab_down_stops_the_registry_with_a_login_by_its_pid(auth_lab_dir):
    lab._start_registry(progress=lambda message: None, login=True)
    pid = lab.running_pid("auth-registry", str(auth_lab_dir / "auth-registry" / "config.yml"))
    said = []
    lab.down(progress=said.append)
    assert _has_exited(pid)
    assert not (auth_lab_dir / "pids" / "auth-registry.pid").exists()
    assert not lab.registry_answers("127.0.0.1", lab.AUTH_REGISTRY_PORT, login=True)
    assert "registry with a login stopped" in said


# --- Debian packages ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "missing, package",
    [
        ("docker-registry", "docker-registry"),
        ("htpasswd", "apache2-utils"),
        ("iptables", "iptables"),
        ("ch-run", "charliecloud"),
        ("mksquashfs", "squashfs-tools"),
        ("squashfuse", "squashfuse"),
    ],
)
def test_lab_up_installs_the_package_of_a_missing_command(tmp_path, monkeypatch, missing, package):
    # Every other command the lab needs is there; apt-get records what it was asked to do.
    bin_dir, calls = tmp_path / "bin", tmp_path / "apt-get.calls"
    bin_dir.mkdir()
    for command in [c for c in lab.REQUIRED_COMMANDS if c != missing] + ["apt-get"]:
        (bin_dir / command).write_text(f'#!/bin/sh\necho "$0 $*" >> {calls}\n')
        (bin_dir / command).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    lab.ensure_packages(progress=lambda message: None)
    install = calls.read_text().splitlines()[-1].split()
    assert install[1:4] == ["install", "-y", "-q"] and package in install, install


def test_lab_up_installs_python3_lark_when_debians_python3_cannot_import_it(tmp_path, monkeypatch):
    # ch-image imports lark on Debian's python3: a machine with every command but not that module gets the package.
    bin_dir, calls = tmp_path / "bin", tmp_path / "apt-get.calls"
    bin_dir.mkdir()
    for command in [*lab.REQUIRED_COMMANDS, "apt-get"]:
        (bin_dir / command).write_text(f'#!/bin/sh\necho "$0 $*" >> {calls}\n')
        (bin_dir / command).chmod(0o755)
    without_lark = tmp_path / "python3"
    without_lark.write_text(
        f"#!/bin/sh\nexec {lab.SYSTEM_PYTHON} -I -c \"import sys; sys.modules['lark'] = None; $2\"\n"
    )
    without_lark.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(lab, "SYSTEM_PYTHON", str(without_lark))
    lab.ensure_packages(progress=lambda message: None)
    assert "python3-lark" in calls.read_text().splitlines()[-1].split()


def test_lab_down_waits_for_an_up_that_is_under_way(lab_dir):
    # Two test processes (xdist workers) or two shells bringing the lab up at once must take turns: `down` (as `up`)
    # starts only once the other's `up` has finished.
    order = []
    with lab._one_at_a_time():
        stopping = threading.Thread(target=lambda: (lab.down(progress=order.append), order.append("down returned")))
        stopping.start()
        stopping.join(1.0)
        assert stopping.is_alive() and order == [], order
        order.append("up finished")
    stopping.join(60)
    assert order[0] == "up finished" and order[-1] == "down returned", order


def test_a_node_daemon_without_the_base_image_gets_it_built_and_it_runs(private_dockerd, tmp_path):
    # What `lab up` does for a node new to this machine (a fresh lab, or the lab grown to node4 and more).
    node = type("Node", (), {"name": "node9", "docker_socket": private_dockerd.socket, "dir": tmp_path})()
    told = []
    private_dockerd.docker("image", "rm", "-f", lab.BASE_IMAGE, check=False)
    lab._ensure_base_image(node, told.append)
    assert told == [f"node9: building the base image {lab.BASE_IMAGE}"]
    ran = private_dockerd.docker("run", "--rm", "--network=none", lab.BASE_IMAGE, "sh", "-c", "echo ok; ls -d /tmp")
    assert ran.stdout.split() == ["ok", "/tmp"]
    lab._ensure_base_image(node, told.append)  # held now: nothing more to build
    assert len(told) == 1


def test_lab_up_hands_a_nodes_docker_socket_to_the_docker_group_whose_members_alone_may_connect():
    # A daemon started before the docker group existed made its socket root's alone; `lab up` repairs that.
    ensure_user(USER, groups=(TEAM, lab.DOCKER_GROUP))
    ensure_user(HOSTILE)
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-node-"))
    place.chmod(0o755)
    node = type("Node", (), {"name": "node9", "docker_socket": place / "docker.sock", "dir": place})()
    connect = f"import socket; socket.socket(socket.AF_UNIX).connect({str(node.docker_socket)!r})"
    try:
        with socket.socket(socket.AF_UNIX) as daemon:
            daemon.bind(str(node.docker_socket))
            daemon.listen()
            node.docker_socket.chmod(0o600)
            assert run_as(USER, [system_python(), "-c", connect]).returncode != 0
            lab._ensure_docker_group()
            lab._share_docker_socket(node)
            shared = node.docker_socket.stat()
            assert (grp.getgrgid(shared.st_gid).gr_name, stat.S_IMODE(shared.st_mode)) == (lab.DOCKER_GROUP, 0o660)
            assert run_as(USER, [system_python(), "-c", connect]).returncode == 0
            assert run_as(HOSTILE, [system_python(), "-c", connect]).returncode != 0
    finally:
        shutil.rmtree(place)
