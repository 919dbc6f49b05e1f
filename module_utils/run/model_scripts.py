"""Each node's own copy of the model's scripts (the running stage), under its results dir, since a model writes into
its working dir. The copy is made once, on the controller, for every node."""

from __future__ import annotations

import os
import shutil
from typing import List, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# MAD's rule: a card whose `scripts` names a directory runs its run.sh.
DEFAULT_SCRIPT = "run.sh"


class ModelScriptsError(UserError):
    """The model's scripts cannot be found or copied; the message says which path and what to fix."""


def scripts_source(scripts: str) -> Tuple[str, str]:
    """(the directory copied into each workspace, the script run inside it) for a card's ``scripts`` path: a directory
    runs its ``run.sh``; a file runs by name, its whole directory copied beside it (scripts source their neighbours)."""
    if os.path.isdir(scripts):
        return scripts, DEFAULT_SCRIPT
    if not os.path.isfile(scripts):
        raise ModelScriptsError(
            f"the model's scripts {scripts} do not exist: check the model card's `scripts` (a path relative to "
            f"the directory of models_file)"
        )
    return os.path.dirname(scripts) or ".", os.path.basename(scripts)


def copy_scripts(source_dir: str, workspaces: Sequence[str]) -> List[str]:
    """Copy ``source_dir``'s contents into every workspace (made when missing), as ``cp -a source/. ws/`` would;
    returns the workspaces, in order."""
    copied = []
    for workspace in workspaces:
        try:
            os.makedirs(workspace, exist_ok=True)
            shutil.copytree(source_dir, workspace, symlinks=True, dirs_exist_ok=True)
        except (OSError, shutil.Error) as error:
            raise ModelScriptsError(f"cannot copy the model's scripts {source_dir} into {workspace}: {error}") from None
        copied.append(workspace)
    return copied
