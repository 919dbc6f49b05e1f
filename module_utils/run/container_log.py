"""A running container's log, followed into the node's ``run.log`` with the job's secret values masked line by line,
and ``run.log.times`` offset marks so `slurm-multi logs` interleaves the ranks' lines as they were written."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Iterable, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import docker_argv
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SecretMasker

# A model printing without newlines must not make one line take all the memory: longer lines are cut in parts.
_MAX_LOG_LINE = 1 << 20
# A time mark in run.log.times at most this often (seconds): lines written closer together share one.
TIME_MARK_INTERVAL = 0.05
TIMES_SUFFIX = ".times"


def copy_log(source, out, times, secret_values: Iterable[str], offset: int = 0) -> None:
    """Copy ``source`` (a binary stream) into ``out`` (holding ``offset`` bytes already) line by line, secrets masked,
    with time marks into ``times``; closes all three at its end."""
    marked = None
    masker = SecretMasker(secret_values)
    with out, source, times:
        for line in iter(lambda: source.readline(_MAX_LOG_LINE), b""):
            now = time.time()
            if marked is None or now - marked >= TIME_MARK_INTERVAL:
                # The mark first: a reader that sees the line also sees when it came.
                times.write(f"{offset} {now:.3f}\n".encode("ascii"))
                times.flush()
                marked = now
            data = masker.feed(line)
            out.write(data)
            out.flush()
            offset += len(data)
        out.write(masker.flush())


def copy_log_in_background(
    source, path: str, secret_values: Iterable[str], head: Sequence[str] = ()
) -> threading.Thread:
    """`copy_log` of ``source`` into ``path`` (and ``path`` + `TIMES_SUFFIX`), from scratch after ``head`` (the
    container's command: `write_log_head`), in a daemon thread."""
    out = open(path, "wb")
    times = open(path + TIMES_SUFFIX, "wb")
    offset = _write_head(out, times, head)
    thread = threading.Thread(target=copy_log, args=(source, out, times, list(secret_values), offset), daemon=True)
    thread.start()
    return thread


class LogFollower:
    """``docker logs -f`` of the container into the node's run.log, with secret values masked line by line."""

    def __init__(self, container: str, path: str, secret_values: Iterable[str], head: Sequence[str] = ()):
        self.container = container
        self.path = path
        self.secret_values = list(secret_values)
        # Lines that open the file, before the container's (the container's command: `write_log_head`).
        self.head = list(head)
        self._process: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, follow: bool = True) -> LogFollower:
        """Start copying the log (to its end with ``follow``, else what it holds now) into the file, from scratch."""
        command = docker_argv(["logs", *(["--follow"] if follow else []), self.container])
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._thread = copy_log_in_background(self._process.stdout, self.path, self.secret_values, self.head)
        return self

    def finish(self, timeout: float) -> bool:
        """Wait for the log to drain (the follow ends with the container); False when it did not end cleanly."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._process.kill()
            self._thread.join(5)
        return self._process.wait() == 0

    def drain(self, timeout: float) -> None:
        """Wait for the log to drain; if following broke off (a signal), fetch the whole log again into the file."""
        if not self.finish(timeout):
            LogFollower(self.container, self.path, self.secret_values, self.head).start(follow=False).finish(timeout)


def write_log_head(path: str, head: Sequence[str]) -> None:
    """Start the log with ``head`` (already masked) before the container exists: a start that fails leaves it too."""
    with open(path, "wb") as out, open(path + TIMES_SUFFIX, "wb") as times:
        _write_head(out, times, head)


def _write_head(out, times, head: Sequence[str]) -> int:
    data = "".join(line + "\n" for line in head).encode("utf-8")
    if data:
        times.write(f"0 {time.time():.3f}\n".encode("ascii"))
        out.write(data)
        out.flush()
    return len(data)
