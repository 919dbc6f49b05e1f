"""The project's own code run by an ordinary local user (tests/support/users/local_users.py), as a real process of
theirs.

The user runs the system Python (every user may), with this checkout, its collections/ and the venv's site-packages
(jinja2, PyYAML, pandas: built for the same Python minor version) on its path: the venv's own interpreter links
into /root, which they cannot enter. `slurm-multi` is then `python -m slurm_multi.cli`, and ansible-playbook is
found beside the venv's (its dry run names it, nothing runs it).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.support.users.local_users import run_as, start_as, system_python

ROOT = Path(__file__).resolve().parents[3]


def user_environment(home: str, **extra: str) -> list[str]:
    """`env` words giving a user's process this checkout's code, `home` as HOME, and `extra`."""
    site_packages = sysconfig.get_paths()["purelib"]
    words = [
        f"PYTHONPATH={ROOT}:{ROOT / 'collections'}:{site_packages}",
        f"PATH={Path(sys.executable).parent}:/usr/bin:/bin",
        f"HOME={home}",
        "PYTHONDONTWRITEBYTECODE=1",
    ]
    return ["env", *words, *(f"{name}={value}" for name, value in extra.items())]


def run_python_as(user: str, script: str, *args: str, home: str, **kwargs) -> subprocess.CompletedProcess:
    """`script` (Python source) run to its end by `user` with the project's code importable."""
    env = kwargs.pop("env", {})
    argv = [*user_environment(home, **env), system_python(), "-c", script, *args]
    return run_as(user, argv, **kwargs)


def start_python_as(user: str, script: str, *args: str, home: str, **kwargs) -> subprocess.Popen:
    """`script` started by `user` (text pipes for stdin and stdout); the caller waits for it or stops it by its pid."""
    argv = [*user_environment(home), system_python(), "-c", script, *args]
    kwargs = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return start_as(user, argv, **kwargs)


def slurm_multi_as(user: str, args: list[str], *, home: str, **kwargs) -> subprocess.CompletedProcess:
    """`slurm-multi ARGS` run to its end by `user`, in HOME `home`."""
    env = kwargs.pop("env", {})
    argv = [*user_environment(home, **env), system_python(), "-m", "slurm_multi.cli", *args]
    return run_as(user, argv, cwd=home, **kwargs)
