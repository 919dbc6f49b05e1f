"""The docker CLI as node-side code uses it: argv lists (never a shell), a timeout on every call, clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import threading
from typing import List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_api import image_inspection
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

DEFAULT_TIMEOUT = 120.0
STDERR_TAIL_CHARS = 2000
PIPE_BYTES = 1 << 20

_NO_SUCH_IMAGE = re.compile(r"no such image|no such object", re.IGNORECASE)


class DockerError(UserError):
    """A docker CLI call that failed, timed out or could not start; keeps its argv and the tail of its stderr."""

    def __init__(self, argv: Sequence[str], problem: str, stderr: str = "", returncode: Optional[int] = None):
        self.argv = list(argv)
        self.problem = problem
        self.stderr_tail = stderr.strip()[-STDERR_TAIL_CHARS:]
        self.returncode = returncode
        message = f"`{shlex.join(self.argv)}` {problem}"
        if self.stderr_tail:
            message += f": {self.stderr_tail}"
        super().__init__(message)


def docker_argv(args: Sequence[str], host: Optional[str] = None) -> List[str]:
    """The full argv of a docker CLI call: `docker [--host HOST] ARGS...`."""
    return ["docker"] + (["--host", host] if host else []) + [str(arg) for arg in args]


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


def run_docker(
    args: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT,
    input=None,
    host: Optional[str] = None,
    check: bool = True,
    extra_env: Optional[Mapping[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Run `docker ARGS...` to completion, stdout and stderr as text; `input` goes to its stdin (a password).
    DockerError when the CLI is missing, outlives `timeout` (killed), or, with `check`, exits non-zero."""
    argv = docker_argv(args, host)
    if isinstance(input, str):
        input = input.encode("utf-8")
    try:
        completed = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            timeout=timeout,
            env=dict(os.environ, **extra_env) if extra_env else None,
        )
    except FileNotFoundError:
        raise DockerError(argv, "could not start: the docker CLI is not on PATH (install docker or fix PATH)") from None
    except subprocess.TimeoutExpired as err:
        raise DockerError(argv, f"timed out after {timeout:g} s", _text(err.stderr)) from None
    result = subprocess.CompletedProcess(argv, completed.returncode, _text(completed.stdout), _text(completed.stderr))
    if check and result.returncode != 0:
        raise DockerError(argv, f"failed (exit {result.returncode})", result.stderr, result.returncode)
    return result


def image_inspect(ref: str, host: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> Optional[dict]:
    """`docker image inspect REF` as a dict, or None when the daemon has no such image."""
    inspected = image_inspection(ref, host=host, timeout=timeout)  # the CLI's answer without its process
    if inspected is not None:
        return inspected or None
    completed = run_docker(["image", "inspect", "--", ref], timeout=timeout, host=host, check=False)
    if completed.returncode != 0:
        if _NO_SUCH_IMAGE.search(completed.stderr):
            return None
        raise DockerError(
            completed.args, f"failed (exit {completed.returncode})", completed.stderr, completed.returncode
        )
    try:
        return json.loads(completed.stdout)[0]
    except (ValueError, IndexError, TypeError):
        raise DockerError(completed.args, "printed output that is not an image inspection", completed.stdout) from None


def image_id(ref: str, host: Optional[str] = None) -> Optional[str]:
    """The ID (`sha256:<hex>`) of the image REF (a tag or an ID) names on the daemon, or None when it has none."""
    inspected = image_inspect(ref, host=host)
    return inspected.get("Id") if inspected else None


def _widen_pipe(pipe) -> None:
    # A 64 KiB pipe makes the CLI and us take turns every 64 KiB; 1 MiB (the unprivileged maximum) lets images
    # of many GB stream with far fewer context switches. Linux only; elsewhere the default stays.
    with contextlib.suppress(ImportError, OSError):
        import fcntl

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)


class DockerStream:
    """A docker CLI process whose stdin ("in") or stdout ("out") the caller streams through `pipe`, killed after
    `timeout` or when the context is left without `finish`."""

    def __init__(self, args: Sequence[str], direction: str, timeout: float, host: Optional[str] = None):
        if direction not in ("in", "out"):
            raise ValueError(f"direction must be 'in' or 'out', not {direction!r}")
        self.argv = docker_argv(args, host)
        self.timeout = timeout
        self._stdout_file = None if direction == "out" else tempfile.TemporaryFile()
        self._stderr_file = tempfile.TemporaryFile()
        self.timed_out = False
        self._finished = False
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if direction == "in" else subprocess.DEVNULL,
                stdout=subprocess.PIPE if direction == "out" else self._stdout_file,
                stderr=self._stderr_file,
            )
        except FileNotFoundError:
            self._close_files()
            raise DockerError(
                self.argv, "could not start: the docker CLI is not on PATH (install docker or fix PATH)"
            ) from None
        self.pipe = self.process.stdin if direction == "in" else self.process.stdout
        _widen_pipe(self.pipe)
        self._watchdog = threading.Timer(timeout, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        self.timed_out = True
        self.process.kill()

    def _close_files(self) -> None:
        for handle in (self._stdout_file, self._stderr_file):
            if handle is not None:
                handle.close()

    @staticmethod
    def _read_back(handle) -> str:
        if handle is None:
            return ""
        handle.seek(0)
        return _text(handle.read())

    def finish(self) -> subprocess.CompletedProcess:
        """Close our end of the pipe, wait for the CLI and return it; DockerError if it failed or timed out."""
        self._finished = True
        with contextlib.suppress(BrokenPipeError):  # the CLI already exited; its exit status below says why
            self.pipe.close()
        returncode = self.process.wait()
        self._watchdog.cancel()
        stdout, stderr = self._read_back(self._stdout_file), self._read_back(self._stderr_file)
        self._close_files()
        if self.timed_out:
            raise DockerError(self.argv, f"timed out after {self.timeout:g} s", stderr)
        if returncode != 0:
            raise DockerError(self.argv, f"failed (exit {returncode})", stderr, returncode)
        return subprocess.CompletedProcess(self.argv, returncode, stdout, stderr)

    def abort(self) -> None:
        """Kill the CLI before it has finished (no-op when it already exited)."""
        self._finished = True
        self._watchdog.cancel()
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(BrokenPipeError):
            self.pipe.close()
        self.process.wait()
        self._close_files()

    def __enter__(self) -> DockerStream:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self._finished:
            self.abort()
