"""A job's modules reach only this user's own module server (slurm-multi-module-client,
slurm_multi/speedup/module_server.py), and the server deletes nothing but its own stale sockets. Acted by real local
users (tests/support/users/local_users.py): USER runs the job's client and server; HOSTILE, another user of the
node, plants a dir, a link or a listening socket under the names USER's job uses, and records every byte that
reaches it.

The node's shared dir is a fresh sticky dir every user may write in (as /dev/shm is), given to both sides as
$SLURM_MULTI_MODULE_SERVER_DIR. What the client and the server report goes to the node's syslog: while a test runs,
it reads /dev/log itself when nothing else listens there."""

import contextlib
import fcntl
import os
import pwd
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.users.local_users import HOSTILE, TEAM, USER, ensure_user, run_as, start_as, system_python

ROOT = Path(__file__).resolve().parents[4]
NODE = "node7"
SYSLOG = "/dev/log"

# HOSTILE's listener: binds argv[1] (making its dir first, mode argv[3], when asked), says it listens, and appends
# every connection's bytes and passed descriptors to argv[2].
HOSTILE_LISTENER = """
import array, os, socket, sys
path, record, make_dir = sys.argv[1], sys.argv[2], sys.argv[3]
if make_dir != "-":
    os.mkdir(os.path.dirname(path), int(make_dir, 8))
    os.chmod(os.path.dirname(path), int(make_dir, 8))
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
os.chmod(path, 0o777)
listener.listen(16)
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    conn.settimeout(3)
    received, fds = b"", 0
    try:
        while True:
            data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(16))
            for _, _, passed in ancillary:  # the client's stdout and stderr: kept, they would hold its output open
                for fd in array.array("i", passed[: len(passed) - len(passed) % 4]):
                    os.close(fd)
                    fds += 1
            if not data:
                break
            received += data
    except OSError:
        pass
    conn.close()
    with open(record, "ab") as out:
        out.write(b"connection: %d bytes, %d fds\\n" % (len(received), fds) + received + b"\\n")
"""

# The module: says it ran, and who its grandparent is (the server, when a fork of the server ran it).
WHO_RAN_ME = """
import os
parent = os.getppid()
grandparent = open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[1]
print("module ran; grandparent", grandparent)
"""

# USER's module server, run by the system Python from the checkout (its top-level imports are the standard
# library's; Ansible's warm-up is main()'s, left out here).
SERVER = (
    f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
    "from slurm_multi.speedup import module_server; module_server.serve()"
)


@pytest.fixture
def users():
    ensure_user(USER)
    ensure_user(HOSTILE)
    return pwd.getpwnam(USER), pwd.getpwnam(HOSTILE)


@pytest.fixture
def node_dir():
    """The node's shared dir, as /dev/shm is: on tmpfs, sticky, every user may write in it."""
    base = tempfile.mkdtemp(prefix="shm-", dir="/dev/shm")
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def module_python():
    """slurm-multi-module-python and its client from the checkout, beside a `python3` USER can run."""
    bin_dir = tempfile.mkdtemp(prefix="module-python-")
    os.chmod(bin_dir, 0o755)
    for name in ("slurm-multi-module-python", "slurm-multi-module-client"):
        os.symlink(ROOT / "slurm_multi" / "speedup" / name, os.path.join(bin_dir, name))
    os.symlink(system_python(), os.path.join(bin_dir, "python3"))
    yield os.path.join(bin_dir, "slurm-multi-module-python")
    shutil.rmtree(bin_dir)


@pytest.fixture
def hostile_record(users):
    """A file only HOSTILE writes: what HOSTILE's listeners received."""
    where = tempfile.mkdtemp(prefix="hostile-")
    os.chown(where, users[1].pw_uid, users[1].pw_gid)
    yield os.path.join(where, "received")
    shutil.rmtree(where)


@pytest.fixture
def node_syslog():
    """The datagrams sent to the node's syslog while the test runs, or None where a syslog daemon owns /dev/log.
    One test at a time holds /dev/log (a lock), and each test's job ID is its own."""
    with open("/tmp/slurm-multi-tests-dev-log.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.lexists(SYSLOG):
            yield None
            return
        reader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        reader.bind(SYSLOG)
        os.chmod(SYSLOG, 0o666)
        reader.setblocking(False)

        def received() -> list:
            lines = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    lines.append(reader.recv(1 << 16).decode(errors="replace"))
            return lines

        try:
            yield received
        finally:
            reader.close()
            os.unlink(SYSLOG)


def job_env(node_dir: str, **extra) -> dict:
    return {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": str(secrets.randbelow(10**6) + 1000),
        "SLURMD_NODENAME": NODE,
        "SLURM_MULTI_MODULE_SERVER_DIR": node_dir,
        # What a module's environment carries that no other user may see: the barrier token, MAD_SECRETS_*.
        "MAD_SECRETS_HF_TOKEN": "secret-" + secrets.token_hex(8),
        **extra,
    }


def own_dir(node_dir: str, users, key: str = "") -> str:
    return os.path.join(node_dir, f"slurm-multi-modules-{users[0].pw_uid}" + (f"-{key}" if key else ""))


def start_hostile_listener(path: str, record: str, make_dir: str = "-") -> subprocess.Popen:
    listener = start_as(
        HOSTILE, [system_python(), "-c", HOSTILE_LISTENER, path, record, make_dir], stdout=subprocess.PIPE
    )
    assert listener.stdout.readline() == b"listening\n"
    return listener


@contextlib.contextmanager
def running(process: subprocess.Popen):
    try:
        yield process
    finally:
        process.terminate()
        process.wait(10)


def run_module(module_python: str, env: dict) -> subprocess.CompletedProcess:
    return run_as(USER, [module_python], input=WHO_RAN_ME, env=env, timeout=60)


def what_hostile_received(record: str) -> bytes:
    time.sleep(0.2)  # a connection the listener accepted is recorded once it ends
    return Path(record).read_bytes() if os.path.exists(record) else b""


def reports(node_syslog, env: dict, ident: str) -> list:
    return [line for line in node_syslog() if ident in line and f"job {env['SLURM_JOB_ID']} on" in line]


def assert_ran_fresh_and_reported_once(ran, env, node_syslog, reason: str) -> None:
    assert ran.returncode == 0 and ran.stdout.startswith("module ran"), ran.stdout + ran.stderr
    if node_syslog is not None:
        said = reports(node_syslog, env, "slurm-multi-module-client")
        assert len(said) == 1 and reason in said[0], said
        assert "the module ran in a fresh Python, nothing was sent there" in said[0]
        assert env["MAD_SECRETS_HF_TOKEN"] not in said[0]


def test_a_dir_another_user_planted_gets_nothing_of_the_module(
    users, node_dir, module_python, hostile_record, node_syslog
):
    env = job_env(node_dir)
    planted = os.path.join(own_dir(node_dir, users), f"{env['SLURM_JOB_ID']}.{NODE}.sock")
    with running(start_hostile_listener(planted, hostile_record, make_dir="0777")):
        ran = run_module(module_python, env)
        assert what_hostile_received(hostile_record) == b""  # not even a connection: the dir is refused first
    assert_ran_fresh_and_reported_once(ran, env, node_syslog, f"belongs to uid {users[1].pw_uid}")


def test_a_link_planted_as_the_dir_gets_nothing_of_the_module(
    users, node_dir, module_python, hostile_record, node_syslog
):
    env = job_env(node_dir)
    hostiles = os.path.join(node_dir, "hostile-" + secrets.token_hex(4))
    with running(start_hostile_listener(f"{hostiles}/{env['SLURM_JOB_ID']}.{NODE}.sock", hostile_record, "0755")):
        run_as(HOSTILE, ["ln", "-s", hostiles, own_dir(node_dir, users)], check=True)
        ran = run_module(module_python, env)
        assert what_hostile_received(hostile_record) == b""
    assert_ran_fresh_and_reported_once(ran, env, node_syslog, "is a symbolic link")


def test_a_dir_of_the_users_that_others_may_write_in_is_not_used(
    users, node_dir, module_python, hostile_record, node_syslog
):
    # USER's own dir, but group-writable: a teammate (HOSTILE is in the same team) puts a listener in it.
    env = job_env(node_dir)
    directory = own_dir(node_dir, users)
    run_as(USER, ["sh", "-c", f"mkdir {directory} && chgrp {TEAM} {directory} && chmod 0770 {directory}"], check=True)
    with running(start_hostile_listener(f"{directory}/{env['SLURM_JOB_ID']}.{NODE}.sock", hostile_record)):
        ran = run_module(module_python, env)
        assert what_hostile_received(hostile_record) == b""
    assert_ran_fresh_and_reported_once(ran, env, node_syslog, "has mode 0770, not 0700")


def test_another_users_listener_in_the_users_own_dir_gets_nothing(
    users, node_dir, module_python, hostile_record, node_syslog
):
    # HOSTILE's listening socket, moved into USER's 0700 dir (by root here): the dir passes, the listener's uid not.
    env = job_env(node_dir)
    hostiles = os.path.join(node_dir, "hostile-" + secrets.token_hex(4))
    name = f"{env['SLURM_JOB_ID']}.{NODE}.sock"
    directory = own_dir(node_dir, users)
    run_as(USER, ["mkdir", "-m", "0700", directory], check=True)
    with running(start_hostile_listener(f"{hostiles}/{name}", hostile_record, "0755")):
        os.rename(f"{hostiles}/{name}", f"{directory}/{name}")
        os.chown(f"{directory}/{name}", users[0].pw_uid, users[0].pw_gid)
        ran = run_module(module_python, env)
        received = what_hostile_received(hostile_record)
    assert received == b"connection: 0 bytes, 0 fds\n\n"  # it connected, checked the listener, sent nothing
    assert_ran_fresh_and_reported_once(ran, env, node_syslog, f"is a listener of uid {users[1].pw_uid}")


def test_the_server_still_serves_the_job_when_another_user_took_its_dir(
    users, node_dir, module_python, hostile_record, node_syslog
):
    key = secrets.token_hex(16)  # the push controller's, in the server's step and every task's
    env = job_env(node_dir, SLURM_MULTI_MODULE_SERVER_KEY=key)
    planted = os.path.join(own_dir(node_dir, users), f"{env['SLURM_JOB_ID']}.{NODE}.sock")
    with running(start_hostile_listener(planted, hostile_record, make_dir="0777")):
        with running(start_as(USER, [system_python(), "-c", SERVER], env=env)) as server:
            served_at = os.path.join(own_dir(node_dir, users, key), f"{env['SLURM_JOB_ID']}.{NODE}.sock")
            deadline = time.monotonic() + 30
            while not os.path.exists(served_at):
                assert server.poll() is None and time.monotonic() < deadline, "the server does not serve the job"
                time.sleep(0.05)
            ran = run_module(module_python, env)
        assert what_hostile_received(hostile_record) == b""
    assert ran.returncode == 0 and ran.stdout == f"module ran; grandparent {server.pid}\n", ran.stdout + ran.stderr
    assert not os.path.exists(own_dir(node_dir, users, key))  # the run's own dir goes with its server
    if node_syslog is not None:
        said = reports(node_syslog, env, "slurm-multi-module-server")
        assert len(said) == 1 and f"belongs to uid {users[1].pw_uid}" in said[0], said
        assert (
            f"serving the job's modules in {own_dir(node_dir, users)}-<the run's key> instead" in said[0]
            and key not in said[0]
        )
        assert reports(node_syslog, env, "slurm-multi-module-client") == []


def test_starting_the_server_deletes_nothing_through_a_planted_link(users, node_dir):
    # HOSTILE links the server's dir name to a 0700 dir of USER's holding a key and a stale socket.
    user = users[0]
    keys = tempfile.mkdtemp(prefix=".ssh-module-server-", dir=user.pw_dir)
    key_file, stale_socket = os.path.join(keys, "id_ed25519"), os.path.join(keys, "agent.sock")
    try:
        Path(key_file).write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ended:
            ended.bind(stale_socket)
        for path in (keys, key_file, stale_socket):
            os.chown(path, user.pw_uid, user.pw_gid)
        key = secrets.token_hex(16)
        env = job_env(node_dir, SLURM_MULTI_MODULE_SERVER_KEY=key)
        run_as(HOSTILE, ["ln", "-s", keys, own_dir(node_dir, users)], check=True)
        name = f"{env['SLURM_JOB_ID']}.{NODE}.sock"
        with running(start_as(USER, [system_python(), "-c", SERVER], env=env)) as server:
            deadline = time.monotonic() + 30
            # Listening: in the run's own dir, or (the code before) through the link, after its clean-up.
            while not any(os.path.exists(os.path.join(where, name)) for where in (own_dir(node_dir, users, key), keys)):
                assert server.poll() is None and time.monotonic() < deadline, "the server does not serve the job"
                time.sleep(0.05)
            assert sorted(os.listdir(keys)) == ["agent.sock", "id_ed25519"]
    finally:
        shutil.rmtree(keys)


def test_the_server_removes_only_stale_sockets_from_its_dir(users, node_dir):
    # A regular file refuses a connection as an ended server's socket does: it is not a socket, so it stays.
    env = job_env(node_dir)
    directory = own_dir(node_dir, users)
    run_as(USER, ["mkdir", "-m", "0700", directory], check=True)
    kept = os.path.join(directory, "notes.txt")
    Path(kept).write_text("kept\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ended:
        ended.bind(os.path.join(directory, "1.node1.sock"))
    for name in os.listdir(directory):
        os.chown(os.path.join(directory, name), users[0].pw_uid, users[0].pw_gid)
    served_at = os.path.join(directory, f"{env['SLURM_JOB_ID']}.{NODE}.sock")
    with running(start_as(USER, [system_python(), "-c", SERVER], env=env)) as server:
        deadline = time.monotonic() + 30
        while not os.path.exists(served_at):
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        assert sorted(os.listdir(directory)) == sorted(["notes.txt", os.path.basename(served_at)])
    assert stat.S_ISREG(os.lstat(kept).st_mode)


def test_the_users_private_runtime_dir_is_preferred(users, module_python):
    # Where the node gives the user an $XDG_RUNTIME_DIR, no other user can take a name in it.
    runtime = tempfile.mkdtemp(prefix="runtime-")
    os.chown(runtime, users[0].pw_uid, users[0].pw_gid)
    try:
        env = job_env("", XDG_RUNTIME_DIR=runtime)
        del env["SLURM_MULTI_MODULE_SERVER_DIR"]
        served_at = os.path.join(
            runtime, f"slurm-multi-modules-{users[0].pw_uid}", f"{env['SLURM_JOB_ID']}.{NODE}.sock"
        )
        with running(start_as(USER, [system_python(), "-c", SERVER], env=env)) as server:
            deadline = time.monotonic() + 30
            while not os.path.exists(served_at):
                assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.05)
            ran = run_module(module_python, env)
        assert ran.stdout == f"module ran; grandparent {server.pid}\n", ran.stdout + ran.stderr
    finally:
        shutil.rmtree(runtime)


def test_the_server_removes_the_dirs_ended_runs_left_and_nothing_of_another_users(users, node_dir):
    # A server is killed with its step (SIGKILL), so a run that served under its key leaves that dir behind.
    user, hostile = users
    env = job_env(node_dir)
    own = own_dir(node_dir, users)
    ended, starting, hostiles, link = (f"{own}-{secrets.token_hex(16)}" for _ in range(4))
    linked_to = tempfile.mkdtemp(prefix="runs-", dir=user.pw_dir)
    try:
        for directory in (ended, starting, linked_to):
            if directory != linked_to:
                os.mkdir(directory, 0o700)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
                gone.bind(os.path.join(directory, "1.node1.sock"))
            for path in (directory, os.path.join(directory, "1.node1.sock")):
                os.chown(path, user.pw_uid, user.pw_gid)
        os.utime(ended, (time.time() - 3600,) * 2)
        os.utime(linked_to, (time.time() - 3600,) * 2)
        run_as(HOSTILE, ["sh", "-c", f"mkdir -m 0700 {hostiles} && touch {hostiles}/kept"], check=True)
        os.utime(hostiles, (time.time() - 3600,) * 2)
        run_as(HOSTILE, ["ln", "-s", linked_to, link], check=True)
        served_at = os.path.join(own, f"{env['SLURM_JOB_ID']}.{NODE}.sock")
        with running(start_as(USER, [system_python(), "-c", SERVER], env=env)) as server:
            deadline = time.monotonic() + 30
            while not os.path.exists(served_at):
                assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.05)
            assert not os.path.exists(ended)
            assert os.listdir(starting) == ["1.node1.sock"]  # changed just now: its server may be starting
            assert os.listdir(hostiles) == ["kept"] and os.stat(hostiles).st_uid == hostile.pw_uid
            assert os.path.islink(link) and os.listdir(linked_to) == ["1.node1.sock"]
    finally:
        shutil.rmtree(linked_to)
