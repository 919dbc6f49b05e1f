"""A container's log followed into a file, against a real (private) Docker daemon."""

import contextlib
import time
import uuid

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_log import LogFollower

# The fixture docker_host.
pytest_plugins = ("tests.support.lab.model_run_fixtures",)


@contextlib.contextmanager
def running_container(docker_host, image, script):
    """A detached busybox container running ``sh -c script``, removed when the block ends."""
    name = f"slurm-multi-test-log-{uuid.uuid4().hex[:8]}"
    docker_host.docker("run", "-d", "--name", name, image, "sh", "-c", script)
    try:
        yield name
    finally:
        docker_host.docker("rm", "-f", name, check=False)


def _wait_for_exit(docker_host, name, timeout=30.0):
    deadline = time.monotonic() + timeout
    while docker_host.docker("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true":
        assert time.monotonic() < deadline, f"{name} did not end"
        time.sleep(0.1)


def test_the_log_reaches_the_file_with_secret_values_masked_and_ordinary_ones_kept(
    docker_host, busybox_image, tmp_path
):
    script = "echo 'token=hf_s3cr3t-value OMP_NUM_THREADS=4'; echo 'performance: 4 x'"
    with running_container(docker_host, busybox_image[0], script) as name:
        follower = LogFollower(name, str(tmp_path / "run.log"), ["hf_s3cr3t-value"]).start()
        follower.drain(30)

    assert (tmp_path / "run.log").read_text() == "token=******** OMP_NUM_THREADS=4\nperformance: 4 x\n"


def test_a_secret_cut_by_the_followers_line_limit_is_masked(docker_host, busybox_image, tmp_path):
    secret = "hf_straddling-secret-value"
    # One line longer than the follower's cut (1 MiB), the secret starting 5 bytes before it.
    script = f"head -c {(1 << 20) - 5} /dev/zero | tr '\\0' x; echo '{secret} end'"
    with running_container(docker_host, busybox_image[0], script) as name:
        _wait_for_exit(docker_host, name)
        LogFollower(name, str(tmp_path / "run.log"), [secret]).start(follow=False).drain(30)

    log = (tmp_path / "run.log").read_bytes()
    assert secret.encode() not in log
    assert log == b"x" * ((1 << 20) - 5) + b"******** end\n"


def test_a_follow_that_broke_off_is_fetched_again_whole(docker_host, busybox_image, tmp_path, monkeypatch):
    # A signal meant for the run can reach `docker logs --follow` too: the lines after it must not be lost.
    starts = []
    real_start = LogFollower.start
    monkeypatch.setattr(
        LogFollower, "start", lambda self, follow=True: starts.append(follow) or real_start(self, follow)
    )
    log = tmp_path / "run.log"
    with running_container(docker_host, busybox_image[0], "echo before; sleep 3; echo after") as name:
        follower = LogFollower(name, str(log), []).start()
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text() == "before\n"):  # the follow is under way, "after" not yet out
            assert time.monotonic() < deadline, "the follow never copied the first line"
            time.sleep(0.05)
        follower._process.terminate()
        _wait_for_exit(docker_host, name)
        follower.drain(30)

    assert starts == [True, False]  # the broken follow, then the fetch of the whole log
    assert log.read_text() == "before\nafter\n"


def test_the_times_file_says_when_each_line_was_written(docker_host, busybox_image, tmp_path):
    script = "echo first; sleep 0.6; echo second; echo third"
    with running_container(docker_host, busybox_image[0], script) as name:
        follower = LogFollower(name, str(tmp_path / "run.log"), []).start()
        follower.drain(30)

    marks = [line.split() for line in (tmp_path / "run.log.times").read_text().splitlines()]
    offsets = [int(offset) for offset, _ in marks]
    times = [float(when) for _, when in marks]
    # One mark at the first line, one at "second" (0.6 s later); "third" came with it and shares its mark.
    assert offsets == [0, len("first\n")]
    assert 0.4 < times[1] - times[0] < 5 and abs(times[1] - time.time()) < 60
