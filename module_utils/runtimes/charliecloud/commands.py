"""Charliecloud's commands on this node: where they are, the environment they need, runs logged with secrets masked.

`ch-image` is a Python script (`#!/usr/bin/env python3`) that imports `lark`: it runs here under the first Python
that can import lark (Debian's /usr/bin/python3 with python3-lark), never under whatever python3 is first on PATH (a
venv's, which has no lark)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import is_secret_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SecretMasker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# Where a distribution installs them, searched after PATH (a job step's PATH may be short).
SYSTEM_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/sbin")
LARK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
VERSION_TIMEOUT = 30.0
# A build step printing without newlines must not make one line take all the memory: longer lines are cut.
_MAX_LOG_LINE = 1 << 20
_INSTALL_HINT = (
    "install Charliecloud on this node (Debian/Ubuntu: apt-get install charliecloud python3-lark squashfs-tools "
    "squashfuse; OpenHPC: its charliecloud package), or put its bin dir on PATH"
)


class CharliecloudError(UserError):
    """A Charliecloud command missing or failing, worded with its fix."""


def find_command(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The path of command `name`: on PATH, else in the system's bin dirs; None when neither has it."""
    environ = os.environ if environ is None else environ
    found = shutil.which(name, path=environ.get("PATH") or os.defpath)
    if found:
        return found
    for directory in SYSTEM_BIN_DIRS:
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_command(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    found = find_command(name, environ)
    if found is None:
        raise CharliecloudError(f"{name} is not installed on this node (not on PATH nor in /usr/bin): {_INSTALL_HINT}")
    return found


_LARK_PYTHON: Dict[str, str] = {}


def lark_python(environ: Optional[Mapping[str, str]] = None) -> str:
    """A Python that can import lark, which ch-image needs; the system's first, then PATH's python3."""
    if "found" in _LARK_PYTHON:
        return _LARK_PYTHON["found"]
    candidates = list(LARK_PYTHONS) + [find_command("python3", environ) or ""]
    for python in dict.fromkeys(candidate for candidate in candidates if candidate):
        if not os.access(python, os.X_OK):
            continue
        try:
            probe = subprocess.run(
                [python, "-c", "import lark"], capture_output=True, timeout=VERSION_TIMEOUT, check=False
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            _LARK_PYTHON["found"] = python
            return python
    raise CharliecloudError(
        "ch-image needs the Python module lark, and no python3 here has it (tried "
        f"{', '.join(candidates)}): apt-get install python3-lark (Debian/Ubuntu), or pip install lark for "
        "/usr/bin/python3"
    )


def ch_image_argv(args: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """`ch-image ARGS` run by a Python that has lark. The script by its real path: it finds its own modules beside
    it (../lib/charliecloud), and a site may put a symlink to it on PATH (a symlink farm: Spack views, modules)."""
    return [lark_python(environ), os.path.realpath(require_command("ch-image", environ)), *args]


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def ch_environment(storage_dir: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment for ch-image and ch-run: this process's without any secret, with `$USER` (ch-run refuses to
    run without it), ch-image's storage when given, and its build cache off (a git repository that needs a git
    identity a new user lacks: the build turns it on with one of its own, `CharliecloudBuild.env`)."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items() if not is_secret_name(name)}
    env.setdefault("USER", user_name())
    if not env["USER"]:
        env["USER"] = user_name()
    if storage_dir:
        env["CH_IMAGE_STORAGE"] = storage_dir
    env["CH_IMAGE_CACHE"] = "disabled"
    return env


def command_version(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """`NAME --version`'s first line (ch-run prints it on stderr), None when it does not run."""
    path = find_command(name, environ)
    if path is None:
        return None
    argv = ch_image_argv(["--version"], environ) if name == "ch-image" else [path, "--version"]
    try:
        ran = subprocess.run(
            argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT, env=ch_environment(environ=environ)
        )
    except (OSError, subprocess.SubprocessError, CharliecloudError):
        return None
    text = (ran.stdout.strip() or ran.stderr.strip()).splitlines()
    return text[0].strip() if ran.returncode == 0 and text else None


def version_tuple(version: str) -> tuple:
    """(0, 31) of "0.31"; () when it names no version."""
    match = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else ()


def run_logged(argv: List[str], log, header: str, env: Mapping[str, str], secret_values=(), cwd=None) -> int:
    """Run `argv` to its end (no timeout: builds take what they take), `header` and its output written to the open
    binary `log`, secrets masked in every line as it is written; its exit code."""
    masker = SecretMasker(secret_values)
    log.write(f"# {header}\n".encode())
    log.flush()
    try:
        process = subprocess.Popen(
            argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except FileNotFoundError:
        raise CharliecloudError(f"{argv[0]} is not installed on this node: {_INSTALL_HINT}") from None
    with process.stdout:
        for chunk in iter(lambda: process.stdout.readline(_MAX_LOG_LINE), b""):
            log.write(masker.feed(chunk))
            log.flush()
    log.write(masker.flush())
    log.flush()
    return process.wait()
