"""Callback: the controller's per-run work done once. A part of the speed-up layer: its code is
slurm_multi/speedup/preload.py (docs/speedup.md); this is the file Ansible loads."""

DOCUMENTATION = r"""
name: preload_plugins
type: aggregate
short_description: Do the controller's per-run work once - plugins loaded before the forks, payloads and templates kept
description:
  - Part of slurm-multi's speed-up layer (docs/speedup.md; its code is slurm_multi/speedup/preload.py). Does nothing
    when the layer is off (the C(speedup) setting, or an ansible-core whose private names the layer uses changed).
  - Ansible runs every task of every host in a worker process forked from ansible-playbook. A worker that renders a
    template with a filter first loads every filter plugin (Ansible's and the project's, with all they import), and
    forgets them when it exits, so every task paid for it again. Loaded here once, at the playbook's start, the
    plugins are inherited by every forked worker.
  - Each ansible-playbook also builds every module's AnsiballZ payload anew, parsing the module and every
    module_utils file it imports, paid again by every node's playbook of a pull-mode run. The payloads it built are
    kept at the playbook's end in the user's own cache (C($XDG_CACHE_HOME/slurm-multi/ansiballz), else
    C(~/.cache/...); a 0700 dir of theirs under dirs no other user can rename in, opened once and used by its
    descriptor; else nothing is kept), under a key of Ansible's and Python's versions, the content's place and every
    byte of its library/ and module_utils/, and handed to the next playbook at its start. A change to any module or
    module_utils file is a new key; a key no playbook has used for a week is removed.
  - A kept payload carries a checked-hash .pyc beside each source, compiled by the controller's Python. A node's
    Python takes one only where its magic and the source's hash match, and compiles the source otherwise; so a node
    on the controller's venv skips the compile.
  - Every worker also compiles every template it renders (a task's arguments, its conditions, the variables they
    read) from its source, and forgets the code when it exits. The code Jinja compiles from a template is kept in the
    same cache (C(.../slurm-multi/templates), under a key of Ansible's, Jinja's and Python's versions), read when
    this callback loads, before any worker forks; so a template this user's playbooks compiled once is compiled no
    more. A template whose first line overrides Jinja's settings is compiled as before.
  - Prints nothing and changes no result. What it saves is in docs/figures.md, "The speed-up layer".
"""

import os

try:
    from slurm_multi.speedup.preload import PreloadPlugins
except ImportError as missing:  # the layer is not in this Python (slurm-multi's package is not): plain Ansible
    from ansible.plugins.callback import CallbackBase as PreloadPlugins
    from ansible.utils.display import Display

    # The same words as module_servers.py's: Ansible shows one warning for both.
    Display().warning(
        f"slurm-multi's speed-up layer is not in this Python ({missing}); this playbook runs on plain Ansible "
        "(docs/speedup.md)"
    )


class CallbackModule(PreloadPlugins):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "preload_plugins"
    CALLBACK_NEEDS_ENABLED = True
    CONTENT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
