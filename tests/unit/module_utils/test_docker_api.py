"""module_utils/docker_api.py: the daemon's API over its unix socket answers what the CLI would, and gives way to the
CLI (None) wherever it cannot stand in for it; with a real private dockerd and the real CLI beside it."""

import json
import os
import socket
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, image_inspect
from tests.support.lab.signalled_step import in_a_step, sigterms_until_it_ends

NO_DAEMON = "unix:///nonexistent/slurm-multi-test/docker.sock"


def test_the_socket_is_the_one_the_cli_would_use(tmp_path):
    empty_config = {"DOCKER_CONFIG": str(tmp_path)}
    assert docker_api.engine_socket("unix:///run/a.sock", {"DOCKER_HOST": "unix:///run/b.sock"}) == "/run/a.sock"
    assert docker_api.engine_socket(None, {"DOCKER_HOST": "unix:///run/b.sock"}) == "/run/b.sock"
    assert docker_api.engine_socket(None, empty_config) == docker_api.DEFAULT_SOCKET
    # Anything the CLI decides in its own way is left to it.
    assert docker_api.engine_socket(None, {"DOCKER_HOST": "tcp://127.0.0.1:2376"}) is None
    assert docker_api.engine_socket(None, {"DOCKER_HOST": "ssh://node2"}) is None
    assert docker_api.engine_socket(None, dict(empty_config, DOCKER_CONTEXT="remote")) is None
    (tmp_path / "config.json").write_text(json.dumps({"currentContext": "remote"}))
    assert docker_api.engine_socket(None, empty_config) is None
    (tmp_path / "config.json").write_text(json.dumps({"auths": {}, "currentContext": "default"}))
    assert docker_api.engine_socket(None, empty_config) == docker_api.DEFAULT_SOCKET
    (tmp_path / "config.json").write_text("{not json")
    assert docker_api.engine_socket(None, empty_config) is None


def test_the_api_answers_as_the_cli_does(private_dockerd, busybox_image, monkeypatch):
    tag, image_id = busybox_image
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    via_cli = json.loads(private_dockerd.docker("image", "inspect", "--", tag).stdout)[0]
    via_api = docker_api.image_inspection(tag)
    assert via_api["Id"] == via_cli["Id"] == image_id and via_api["RepoTags"] == via_cli["RepoTags"]
    assert via_api["Size"] == via_cli["Size"]
    assert docker_api.image_inspection("slurm-multi-test/no-such-image:latest") == {}
    assert image_inspect("slurm-multi-test/no-such-image:latest") is None
    assert docker_api.server_version() == private_dockerd.docker("version", "-f", "{{.Server.Version}}").stdout.strip()
    root = private_dockerd.docker("info", "-f", "{{.DockerRootDir}}").stdout.strip()
    assert docker_api.server_info("DockerRootDir") == root


def test_a_labelled_container_is_listed_inspected_and_removed(private_dockerd, busybox_image, monkeypatch):
    tag, _ = busybox_image
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    name = f"slurm-multi-api-test-{os.getpid()}"
    private_dockerd.docker(
        "run", "-d", "--network=none", "--name", name, "--label", "slurm-multi.api-test=yes", tag, "sleep", "300"
    )
    try:
        (listed,) = docker_api.labelled_containers("slurm-multi.api-test")
        assert listed[1] == name and listed[2]["slurm-multi.api-test"] == "yes"
        assert docker_api.container_state(name)["Running"] is True
        # `docker top NAME -eo pid,args`: the same processes, by host PID.
        via_cli = private_dockerd.docker("top", name, "-eo", "pid,args").stdout.splitlines()[1:]
        expected = [(pid, args.strip()) for pid, _, args in (line.strip().partition(" ") for line in via_cli)]
        assert docker_api.container_processes(name) == expected
        assert docker_api.container_processes(name)[0][1] == "sleep 300"
        assert docker_api.remove_container(name) is True
        assert docker_api.remove_container(name) is False  # no such container
        assert docker_api.container_state(name) is None  # the CLI names the missing container in its own words
        assert docker_api.container_processes(name) is None
        assert docker_api.labelled_containers("slurm-multi.api-test") == []
    finally:
        private_dockerd.docker("rm", "-f", name, check=False)


def test_where_the_api_cannot_answer_the_cli_does_with_its_own_error(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", NO_DAEMON)
    assert docker_api.image_inspection("busybox") is None
    assert docker_api.server_version() is None and docker_api.remove_container("x") is None
    with pytest.raises(DockerError, match="docker image inspect") as failed:
        image_inspect("busybox")
    assert "nonexistent" in failed.value.stderr_tail  # the CLI's words, naming the socket


@pytest.mark.parametrize(
    "reply",
    [
        b"garbage",
        b"HTTP/1.0 200 OK\r\n\r\n{not json",
        b"HTTP/1.0 500 Internal Server Error\r\n\r\n{}",
        b'HTTP/1.0 200 OK\r\n\r\n{"no": "Id"}',
        b"",
    ],
)
def test_a_socket_answering_anything_else_leaves_the_call_to_the_cli(tmp_path, monkeypatch, reply):
    path = str(tmp_path / "d.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer_once():
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(reply)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        assert docker_api.image_inspection("busybox", host=f"unix://{path}", timeout=5) is None
    finally:
        thread.join(5)
        server.close()


def test_a_stop_the_steps_sigterm_reaches_midway_still_waits_out_the_grace(private_dockerd, busybox_image, monkeypatch):
    tag, _ = busybox_image
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    name = f"slurm-multi-api-stop-{os.getpid()}"
    # PID 1 of a container ignores SIGTERM: only the kill after the grace ends it.
    private_dockerd.docker("run", "-d", "--network=none", "--name", name, tag, "sleep", "300")
    try:
        stopper = in_a_step(
            "from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.docker.rank import (\n"
            "    stop_container,\n"
            ")\n"
            f"stop_container({name!r}, 3)\n"
        )
        output = sigterms_until_it_ends(stopper, after=1.0, every=0.5)
        assert stopper.returncode == 0, output
        assert docker_api.container_state(name)["Running"] is False
        assert docker_api.stop_container(name, 3) is False  # already stopped
    finally:
        private_dockerd.docker("rm", "-f", name, check=False)
    assert docker_api.stop_container(name, 3) is None  # no such container: the CLI says so


def test_an_exec_and_a_log_tail_answer_as_the_cli_does(private_dockerd, busybox_image, monkeypatch):
    tag, _ = busybox_image
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    name = f"slurm-multi-api-exec-{os.getpid()}"
    private_dockerd.docker(
        "run", "-d", "--network=none", "--name", name, tag, "sh", "-c", "echo out; echo err >&2; sleep 300"
    )
    try:
        code, said = docker_api.exec_output(name, ["sh", "-c", "echo one; echo two >&2; exit 4"])
        assert (code, sorted(said.splitlines())) == (4, ["one", "two"])  # two pipes: either may come first
        code, said = docker_api.exec_output(name, ["no-such-program"])
        assert code in (126, 127) and "no-such-program" in said  # the daemon's own words, as the CLI prints them
        deadline = time.monotonic() + 10
        while len((docker_api.container_log_tail(name, 10) or "").split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The CLI splits the two streams; the API gives them as they came.
        cli = private_dockerd.docker("logs", "--tail", "1", name)
        assert docker_api.container_log_tail(name, 1) == cli.stdout + cli.stderr
        assert sorted(docker_api.container_log_tail(name, 10).split()) == ["err", "out"]
    finally:
        private_dockerd.docker("rm", "-f", name, check=False)
    assert docker_api.exec_output(name, ["true"]) is None and docker_api.container_log_tail(name, 1) is None
