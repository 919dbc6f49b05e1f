"""The diagnostics snapshot of a failed or hung container, against a real (private) Docker daemon."""

import uuid

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import (
    collect_container_diagnostics,
    write_container_diagnostics,
)
from tests.support.lab.signalled_step import in_a_step, sigterms_until_it_ends


@pytest.fixture
def docker_host(private_dockerd, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    return private_dockerd


@pytest.fixture
def container(docker_host, busybox_image):
    """Start a container running a shell script (detached, or to its end with wait=True); removed afterwards."""
    names = []

    def start(script, *options, wait=False):
        name = f"diag-{uuid.uuid4().hex[:10]}"
        names.append(name)
        docker_host.docker(
            "run", "-d", "--name", name, "--network=none", *options, busybox_image[0], "sh", "-c", script
        )
        if wait:
            docker_host.docker("wait", name)
        return name

    yield start
    if names:
        docker_host.docker("rm", "-f", *names, check=False)


def _wait_for(docker_host, name, path):
    docker_host.docker("exec", name, "sh", "-c", f"while [ ! -e {path} ]; do sleep 0.05; done", timeout=10)


def test_an_exited_container_reports_its_inspect_state_and_log_tail(container):
    name = container("echo 'loss went nan'; exit 7", wait=True)

    text = collect_container_diagnostics(name)

    for expected in (
        "Status: exited",
        "ExitCode: 7",
        "OOMKilled: False",
        "StartedAt: 20",
        "FinishedAt: 20",
        "loss went nan",
    ):
        assert expected in text


def test_an_exited_container_is_not_probed_from_inside(container):
    text = collect_container_diagnostics(container("exit 1", wait=True))

    assert "== process table" not in text and "== listening sockets" not in text


def test_a_running_container_reports_its_process_table(container):
    name = container("sleep 1000")

    text = collect_container_diagnostics(name)

    assert "Running: True" in text
    assert "== process table" in text and "sleep 1000" in text


def test_a_running_container_reports_its_listening_sockets(container, docker_host):
    # --network=none: the listener lives in the container's own network namespace, on its loopback only.
    name = container("nc -l -p 4567 & touch /ready; sleep 1000")
    _wait_for(docker_host, name, "/ready")

    text = collect_container_diagnostics(name)

    section = text.split("== listening sockets")[1].split("\n== ")[0]
    assert ":4567" in section


def test_the_tails_of_log_files_under_the_log_dirs_are_included(container, docker_host):
    name = container("mkdir -p /run_logs/rank0; seq 1 50 > /run_logs/rank0/train.log; touch /ready; sleep 1000")
    _wait_for(docker_host, name, "/ready")

    text = collect_container_diagnostics(name, log_dirs=["/run_logs"], tail_lines=3)

    section = text.split("== log files under /run_logs")[1].split("\n== ")[0]
    assert "==> /run_logs/rank0/train.log <==\n48\n49\n50" in section
    assert "\n47\n" not in section


def test_environment_values_are_left_out_and_names_kept(container):
    name = container("exit 0", "-e", "DB_PASSWORD=plaintext-db-password", wait=True)

    text = collect_container_diagnostics(name)

    assert "DB_PASSWORD" in text and "plaintext-db-password" not in text


def test_known_secret_values_are_masked(container):
    name = container("echo 'token is hf_secret_in_the_log'; exit 1", wait=True)

    text = collect_container_diagnostics(name, secret_values=["hf_secret_in_the_log"])

    assert "token is ********" in text and "hf_secret_in_the_log" not in text


def test_a_missing_container_is_recorded_not_raised(docker_host):
    text = collect_container_diagnostics("no-such-container-here")

    assert "== docker inspect state ==\nexit code 1: Error response from daemon: No such container" in text


def test_a_command_that_hangs_is_cut_at_its_timeout(container, docker_host):
    # The image's ps replaced by one that never answers.
    name = container(
        "rm /bin/ps; printf '#!/bin/sh\\nsleep 60\\n' > /bin/ps; chmod +x /bin/ps; touch /ready; sleep 1000"
    )
    _wait_for(docker_host, name, "/ready")

    text = collect_container_diagnostics(name, command_timeout=0.5)

    section = text.split("== process table")[1].split("\n== ")[0]
    assert "timed out after 0.5 s" in section
    assert "== container log" in text


def test_a_spent_budget_skips_the_remaining_commands(container):
    name = container("exit 2", wait=True)

    text = collect_container_diagnostics(name, budget=0)

    assert text.count("skipped: the diagnostics time budget is spent") == 2


def test_each_section_is_capped_keeping_the_end_of_logs(container):
    name = container("seq 1 5000; exit 1", wait=True)

    text = collect_container_diagnostics(name, output_cap=200, tail_lines=5000)

    section = text.split("== container log")[1]
    assert "characters cut" in section and section.rstrip().endswith("5000")
    assert len(section) < 400


def test_the_snapshot_is_written_to_the_given_file(container, tmp_path):
    name = container("exit 5", wait=True)

    path = write_container_diagnostics(str(tmp_path / "diagnostics.txt"), name)

    assert "ExitCode: 5" in (tmp_path / "diagnostics.txt").read_text()
    assert path == str(tmp_path / "diagnostics.txt")


def test_a_snapshot_that_sigterms_keep_reaching_still_holds_the_process_table(container):
    # scancel: SLURM's SIGTERM reaches every process of the step while the cancelled run takes its snapshot.
    name = container("sleep 300")
    snapshotter = in_a_step(
        "from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import "
        "collect_container_diagnostics\n"
        f"print(collect_container_diagnostics({name!r}))\n"
    )

    text = sigterms_until_it_ends(snapshotter, after=0.0, every=0.002)

    assert snapshotter.returncode == 0, text
    assert "== process table (ps" in text and "sleep 300" in text
