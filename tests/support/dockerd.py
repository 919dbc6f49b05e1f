"""A private Docker daemon for tests of node-side modules: real `docker save/load/run`, isolated from the lab.

Each pytest session starts its own daemon on its own socket and stops it, by its pid, at the end.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest


class PrivateDockerd:
    """One dockerd with its own data root and socket; `env` points the docker CLI at it."""

    def __init__(self, root: Path):
        self.root = root
        self.socket = root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.process = None

    @property
    def env(self):
        env = dict(os.environ)
        env["DOCKER_HOST"] = self.host
        return env

    def start(self, timeout=30.0):
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "dockerd.log", "wb")
        self.process = subprocess.Popen(
            [
                "dockerd",
                "--data-root",
                str(self.root / "data"),
                "--exec-root",
                str(self.root / "exec"),
                "--pidfile",
                str(self.root / "docker.pid"),
                "-H",
                self.host,
                "--bridge=none",
                "--iptables=false",
                "--ip-masq=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dockerd exited early: {(self.root / 'dockerd.log').read_text()[-2000:]}")
            ok = subprocess.run(["docker", "version"], env=self.env, capture_output=True).returncode == 0
            if ok:
                return self
            time.sleep(0.2)
        log_tail = (self.root / "dockerd.log").read_text()[-2000:]
        raise RuntimeError(f"dockerd did not answer within {timeout}s: {log_tail}")

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # dockerd leaves its default network namespace mounted under exec-root; unmount it or the dir stays.
        netns = self.root / "exec" / "netns" / "default"
        if netns.exists():
            subprocess.run(["umount", "-l", str(netns)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def docker(self, *args, check=True, **kwargs):
        """Run the docker CLI against this daemon."""
        return subprocess.run(["docker", *args], env=self.env, check=check, capture_output=True, text=True, **kwargs)


# Every real-daemon test (the layered publish and load among them) needs this daemon: the skip must not read as a pass.
NOT_ROOT_SKIP = "needs root to start a private dockerd; CI runs as root, so this runs there - a skip here is not a pass"


@contextlib.contextmanager
def running_private_dockerd(prefix: str):
    """A started PrivateDockerd in a fresh temp dir named `prefix...`, stopped when the block ends (a fixture's body).

    Skips the test unless run as root (dockerd needs it), saying that CI runs it. As root it never skips: a missing
    dockerd or docker CLI fails the test, naming it.
    """
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT_SKIP)
    missing = [tool for tool in ("dockerd", "docker") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"running as root, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH: the "
            "real-daemon tests (the layered publish and load among them) cannot start a private dockerd. Install "
            "Docker Engine (docker.io or docker-ce) or put it on PATH: these tests must run as root, never skip",
            pytrace=False,
        )
    daemon = PrivateDockerd(Path(tempfile.mkdtemp(prefix=prefix)))
    daemon.start()
    yield daemon
    daemon.stop()


@contextlib.contextmanager
def job_leaving_no_containers(dockerd: PrivateDockerd, prefix: str):
    """A fresh job ID (`prefix` + 10 hex digits); when the block ends, containers of that job left on `dockerd`
    are removed and fail the test."""
    job = f"{prefix}{uuid.uuid4().hex[:10]}"
    yield job
    left = dockerd.docker("ps", "-a", "-q", "--filter", f"label=slurm-multi.job={job}").stdout.split()
    if left:
        dockerd.docker("rm", "-f", *left, check=False)
    assert left == [], f"containers of job {job} were left behind"


def build_busybox_image(dockerd: PrivateDockerd, tag: str, extra_dockerfile: str = "", extra_files=None) -> str:
    """Build a tiny `FROM scratch` busybox image (works offline) and return its image ID."""
    with tempfile.TemporaryDirectory() as ctx:
        ctx = Path(ctx)
        shutil.copy("/bin/busybox", ctx / "busybox")
        for name, data in (extra_files or {}).items():
            (ctx / name).write_bytes(data)
        (ctx / "Dockerfile").write_text(
            "FROM scratch\nCOPY busybox /bin/busybox\n"
            'RUN ["/bin/busybox", "--install", "-s", "/bin"]\n' + extra_dockerfile + 'CMD ["/bin/sh"]\n'
        )
        dockerd.docker("build", "--network=host", "-q", "-t", tag, str(ctx))
    return dockerd.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
