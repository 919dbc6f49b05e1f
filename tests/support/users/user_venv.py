"""A venv of this checkout that an ordinary local user can run, for lab jobs submitted as that user.

The suite's venv is made from a Python that links into /root (mode 0700): no other user can start it. This one is
made from Debian's /usr/bin/python3 with this checkout installed editable, in /var/tmp where every user may read
it, once per machine and checkout: keyed by the checkout's path and its pyproject.toml, so a fresh clone (CI) or
changed dependencies get their own. `slurm-multi submit` run from it puts its own interpreter into the job (the
sbatch script and the nodes' modules run the venv's Python), as on a cluster where users install slurm-multi
themselves.

A test support function, not a `slurm-multi lab` step: a real cluster's users make their own venv;
only the tests act as a second user on this machine (docs/cluster.md says how a user installs it).
"""

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

from tests.support.ansible import ROOT
from tests.support.users.local_users import system_python

PLACE = Path("/var/tmp")
COMPLETE = "slurm-multi-venv-complete"


def _key() -> str:
    digest = hashlib.sha256(str(ROOT).encode() + b"\0" + (ROOT / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _one_builder(lock: Path):
    """Two test workers asking at once: one builds, the other waits for it and finds it made."""
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _remove_outdated(keep: Path) -> None:
    """The venvs of a checkout that is gone (CI's fresh clones), or of this one's earlier pyproject.toml: each holds
    a few hundred MB."""
    for venv in PLACE.glob("slurm-multi-user-venv-*"):
        try:
            checkout = Path((venv / COMPLETE).read_text().strip())
        except OSError:
            continue  # being built by another test process, or cut short: its builder replaces it
        if venv != keep and (checkout == ROOT or not (checkout / "pyproject.toml").exists()):
            shutil.rmtree(venv, ignore_errors=True)


def ensure_user_venv() -> Path:
    """The venv's directory (its bin/ holds slurm-multi, slurm-multi-playbook and py-spy), made if missing."""
    python = system_python()
    venv = PLACE / f"slurm-multi-user-venv-{_key()}"
    with _one_builder(PLACE / f".{venv.name}.lock"):
        _remove_outdated(venv)
        if (venv / COMPLETE).exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)  # a build that was cut short
        subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
        built = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "-e", str(ROOT)], capture_output=True, text=True
        )
        if built.returncode != 0:
            raise RuntimeError(f"installing {ROOT} into {venv} failed:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
        # Whatever the umask of whoever runs the tests: every user runs it.
        subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
        (venv / COMPLETE).write_text(f"{ROOT}\n")
    return venv
