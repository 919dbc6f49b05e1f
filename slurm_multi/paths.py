"""Where things are: the Ansible content (playbooks, roles, modules), the user's results and jobs' private dirs."""

import os
import time
from pathlib import Path
from secrets import token_hex

STATE_DIR_NAME = ".slurm-multi"


def project_root() -> Path:
    """The directory holding ansible.cfg, playbooks/, roles/, library/ and module_utils/.

    A source checkout has them beside the package; an installed wheel carries them inside it
    (``slurm_multi/ansible_content``). ``SLURM_MULTI_HOME`` overrides both.
    """
    override = os.environ.get("SLURM_MULTI_HOME")
    if override:
        return Path(override).resolve()
    here = Path(__file__).resolve().parent
    for candidate in (here.parent, here / "ansible_content"):
        if (candidate / "ansible.cfg").is_file() and (candidate / "playbooks").is_dir():
            return candidate
    raise RuntimeError(
        f"cannot find the slurm-multi Ansible content (ansible.cfg, playbooks/) beside {here}; "
        "set SLURM_MULTI_HOME to the checkout"
    )


def default_results_dir() -> Path:
    """``$SLURM_MULTI_RESULTS_DIR``, else the user's or the site's settings file's results_dir, else
    ``~/slurm-multi-results`` (module_utils/job/defaults.py, settings_files.py)."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import (
        default_results_dir as results_dir,
    )
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import read_settings

    given = read_settings().values.get("results_dir")
    return Path(str(given)).expanduser().absolute() if given else Path(results_dir())


def private_jobs_dir() -> Path:
    """``~/.slurm-multi/jobs``: one 0700 directory per submission holding its script, vars and secrets files."""
    return Path.home() / STATE_DIR_NAME / "jobs"


def write_new_private_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, a new file that is 0600 from its creation: never readable by others, not even for
    an instant (it must not exist yet)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    return Path(path)


def new_private_dir() -> Path:
    """A new 0700 directory under `private_jobs_dir`, for one job's scripts, vars and secrets files."""
    base = private_jobs_dir()
    for directory in (base.parent, base):
        directory.mkdir(mode=0o700, exist_ok=True)
    path = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{token_hex(3)}"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # whatever the umask
    return path
