"""The module server (slurm_multi/speedup/module_server.py) and its client (slurm-multi-module-client, through
slurm-multi-module-python, beside it): a pipelined module runs as a fork of the job's warm server on its node, as the
process that sent it would have run it, and in a fresh Python wherever there is no server for it."""

import importlib.machinery
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ansible.release import __version__ as ANSIBLE_VERSION

from slurm_multi.speedup.module_server import socket_path
from tests.support.ansible import BIN, ROOT
from tests.support.payloads import captured_payload, with_changed_source

MODULE_PYTHON = BIN / "slurm-multi-module-python"
JOB = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "node7"}
SERVER_MARK = "slurm_multi.speedup.module_server"


def module(body: str, version: str = ANSIBLE_VERSION) -> bytes:
    """A pipelined module: Python code carrying the Ansible version its payload was built by, as AnsiballZ's does."""
    return f'# {{"_ansible_version": "{version}"}}\n{body}'.encode()


# What the module's process is: its parent's command line is the server's when a server ran it (a fork, no exec).
WHO_RUNS_ME = "import os; print(open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' '))\n"


@pytest.fixture
def job_env():
    # A short dir: a unix socket's path has at most 107 bytes, and pytest's tmp_path is longer under xdist.
    servers = tempfile.mkdtemp(prefix="msrv-", dir="/tmp")
    yield dict(os.environ, **JOB, SLURM_MULTI_MODULE_SERVER_DIR=servers)
    shutil.rmtree(servers, ignore_errors=True)


@pytest.fixture
def server(job_env):
    process = subprocess.Popen([sys.executable, "-m", SERVER_MARK], env=job_env)
    path = socket_path(job_env)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert process.poll() is None and time.monotonic() < deadline, "the module server did not come up"
        time.sleep(0.05)
    yield process
    process.terminate()
    process.wait(10)


def run(payload: bytes, env, **options):
    return subprocess.run([str(MODULE_PYTHON)], input=payload, env=env, capture_output=True, timeout=60, **options)


def test_a_module_runs_as_a_fork_of_the_jobs_server_on_its_node(server, job_env):
    ran = run(module(WHO_RUNS_ME), job_env)
    assert ran.returncode == 0, ran.stderr
    assert SERVER_MARK in ran.stdout.decode()


def test_without_a_server_a_module_runs_in_a_fresh_python(job_env):
    ran = run(module(WHO_RUNS_ME + "print('ran')"), job_env)
    assert ran.returncode == 0, ran.stderr
    assert SERVER_MARK not in ran.stdout.decode() and ran.stdout.decode().endswith("ran\n")


def test_with_the_speedup_layer_off_a_module_runs_in_a_fresh_python_though_its_server_listens(server, job_env):
    # $SLURM_MULTI_SPEEDUP as the playbook hands it on (0), or as a user spells false.
    for off in ("0", "false", "No", "OFF"):
        ran = run(module(WHO_RUNS_ME + "print('ran')"), dict(job_env, SLURM_MULTI_SPEEDUP=off))
        assert ran.returncode == 0, ran.stderr
        assert SERVER_MARK not in ran.stdout.decode() and ran.stdout.decode().endswith("ran\n"), off


def test_the_client_started_alone_runs_a_module_fresh_with_the_speedup_layer_off(server, job_env):
    client = [str(BIN / "python3"), "-S", str(BIN / "slurm-multi-module-client")]
    on, off = (
        subprocess.run(client, input=module(WHO_RUNS_ME), env=env, capture_output=True, timeout=60)
        for env in (job_env, dict(job_env, SLURM_MULTI_SPEEDUP="0"))
    )
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert SERVER_MARK in on.stdout.decode() and SERVER_MARK not in off.stdout.decode()


def test_with_the_speedup_layer_off_the_module_server_does_not_start(job_env):
    ran = subprocess.run(
        [sys.executable, "-m", SERVER_MARK], env=dict(job_env, SLURM_MULTI_SPEEDUP="0"), capture_output=True, timeout=60
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, b"", b"")
    assert not os.path.exists(os.path.dirname(socket_path(job_env)))


def test_a_module_built_by_another_ansible_version_runs_in_a_fresh_python(server, job_env):
    # The server's imports would shadow the payload's own Ansible code.
    ran = run(module(WHO_RUNS_ME, version="1.0.0"), job_env)
    assert ran.returncode == 0, ran.stderr
    assert SERVER_MARK not in ran.stdout.decode()


def test_the_module_takes_the_senders_environment_working_dir_and_umask(server, job_env, tmp_path):
    body = "import os; print(os.environ['MARK'], os.getcwd(), oct(os.umask(0)), 'SERVER_ONLY' in os.environ)\n"
    ran = run(
        module(body),
        dict(job_env, MARK="from-the-step"),
        cwd=tmp_path,
        preexec_fn=lambda: os.umask(0o027),
    )
    assert ran.stdout.decode() == f"from-the-step {tmp_path} 0o27 False\n", ran.stderr


def test_the_modules_output_and_exit_status_are_its_own(server, job_env):
    body = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)\n"
    ran = run(module(body), job_env)
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, b"out\n", b"err\n")


def test_a_module_that_raises_shows_its_traceback_and_fails(server, job_env):
    ran = run(module("raise RuntimeError('broken module')\n"), job_env)
    assert ran.returncode == 1
    assert b"RuntimeError: broken module" in ran.stderr


def test_a_signal_to_the_task_reaches_its_module(server, job_env, tmp_path):
    # scancel's SIGTERM to the task's step: the run module stops its container on it.
    marker = tmp_path / "terminated"
    body = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').close(), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    client = subprocess.Popen([str(MODULE_PYTHON)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=job_env)
    client.stdin.write(module(body))
    client.stdin.close()
    assert client.stdout.readline() == b"ready\n"
    client.send_signal(signal.SIGTERM)
    assert client.wait(10) == 7
    assert marker.exists()


def test_a_module_whose_task_was_killed_is_stopped(server, job_env, tmp_path):
    pid_file = tmp_path / "module.pid"
    body = (
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    client = subprocess.Popen([str(MODULE_PYTHON)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=job_env)
    client.stdin.write(module(body))
    client.stdin.close()
    assert client.stdout.readline() == b"ready\n"
    module_pid = int(pid_file.read_text())
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{module_pid}") and _state(module_pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{module_pid}") or _state(module_pid) == "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_real_ansiballz_payload_runs_on_the_server_as_in_a_fresh_python(server, job_env, tmp_path):
    # Ansible's own payload: its ansible.legacy.<module> is only in the payload's zip, beside the server's Ansible.
    payload = captured_payload(tmp_path)
    on_server, fresh = run(payload, job_env), run(payload, dict(job_env, SLURMD_NODENAME="elsewhere"))
    assert on_server.returncode == fresh.returncode == 0, on_server.stdout + on_server.stderr
    assert b'"stdout": "through the payload"' in on_server.stdout and b'"stdout": "through the payload"' in fresh.stdout


def test_the_client_and_the_server_agree_on_where_the_server_listens(tmp_path):
    # The client runs without the project on its path: it has its own copy of the rule.
    from slurm_multi.speedup.module_server import server_dirs, socket_name

    client_file = ROOT / "slurm_multi" / "speedup" / "slurm-multi-module-client"
    loader = importlib.machinery.SourceFileLoader("module_client", str(client_file))
    client = importlib.util.module_from_spec(importlib.util.spec_from_loader("module_client", loader))
    loader.exec_module(client)
    private, open_to_all, link = tmp_path / "private", tmp_path / "open", tmp_path / "link"
    private.mkdir(mode=0o700)
    open_to_all.mkdir(mode=0o755)
    link.symlink_to(private)
    environments = [
        dict(JOB),
        dict(JOB, SLURM_MULTI_MODULE_SERVER_DIR="/tmp/msrv-x", XDG_RUNTIME_DIR=str(private)),
        dict(JOB, SLURM_MULTI_MODULE_SERVER_KEY="0123abcd"),
        dict(JOB, SLURM_MULTI_MODULE_SERVER_KEY="../../elsewhere"),
        *(dict(JOB, XDG_RUNTIME_DIR=str(runtime)) for runtime in (private, open_to_all, link, "relative")),
    ]
    for env in environments:
        assert client.server_dirs(env) == server_dirs(env), env
        assert client.socket_name(env) == socket_name(env), env
    uid = os.getuid()
    assert [server_dirs(env) for env in environments[:4]] == [
        [f"/dev/shm/slurm-multi-modules-{uid}"],
        [f"/tmp/msrv-x/slurm-multi-modules-{uid}"],
        [f"/dev/shm/slurm-multi-modules-{uid}", f"/dev/shm/slurm-multi-modules-{uid}-0123abcd"],
        [f"/dev/shm/slurm-multi-modules-{uid}"],
    ]
    # $XDG_RUNTIME_DIR only where it is the user's private dir: not one others may enter, a link, or relative.
    assert [server_dirs(env)[0] for env in environments[4:]] == [f"{private}/slurm-multi-modules-{uid}"] + [
        f"/dev/shm/slurm-multi-modules-{uid}"
    ] * 3


# A module that says where its module_utils came from: the server's import (the checkout's file) or its payload's zip.
WHICH_UTILS = """from ansible.module_utils.basic import AnsibleModule
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier import wire
AnsibleModule(argument_spec={}).exit_json(utils_file=wire.__file__)
"""


def test_a_payload_carrying_the_servers_module_utils_uses_its_imports_one_that_differs_its_own(
    server, job_env, tmp_path
):
    # The server imported wire.py (the node modules import it): a payload with the same source uses that import.
    library = tmp_path / "library"
    library.mkdir()
    (library / "which_utils.py").write_text(WHICH_UTILS)
    payload = captured_payload(tmp_path, "which_utils:", library=library)
    same = run(payload, job_env)
    assert same.returncode == 0, same.stdout + same.stderr
    assert f'"utils_file": "{ROOT}/module_utils/barrier/wire.py"'.encode() in same.stdout, same.stdout
    # The same payload with wire.py changed by a comment (its bytecode dropped): the payload's own, from its zip.
    changed = run(
        with_changed_source(payload, "module_utils/barrier/wire.py", b"# changed after the server started\n"), job_env
    )
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert (
        b'_payload.zip/ansible_collections/slurm_multi/pipeline/plugins/module_utils/barrier/wire.py"' in changed.stdout
    )


def test_a_server_removes_the_sockets_ended_jobs_servers_left(job_env):
    # A server killed with its job leaves its socket behind in the user's dir on the node.
    stale = Path(socket_path(dict(job_env, SLURM_JOB_ID="4241")))
    stale.parent.mkdir(mode=0o700, parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(stale))
    process = subprocess.Popen([sys.executable, "-m", SERVER_MARK], env=job_env)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(socket_path(job_env)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(socket_path(job_env)) and not stale.exists()
    finally:
        process.terminate()
        process.wait(10)


def test_the_node_modules_whose_imports_the_server_takes_are_the_librarys():
    # A name that drifted from library/ would quietly cost its module's imports in every child again.
    from slurm_multi.speedup.module_server import NODE_MODULES

    assert all((ROOT / "library" / f"{name}.py").is_file() for name in NODE_MODULES), NODE_MODULES
