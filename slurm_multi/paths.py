"""Where the Ansible content (playbooks, roles, modules) lives, for the CLI and the API.

The controller-side package imports the same pure-Python logic that the node-side modules use, from
``module_utils/``, under the name Ansible gives it (``ansible.module_utils.<name>``): one copy of the logic.
"""

import os
from pathlib import Path


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


def use_project_module_utils() -> None:
    """Make ``ansible.module_utils.<name>`` resolve to this project's module_utils/ on the controller."""
    import ansible.module_utils

    extra = str(project_root() / "module_utils")
    if extra not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(extra)
