"""Callback: load the filter and test plugins once, in the ansible-playbook process, before any worker forks."""

DOCUMENTATION = r"""
name: preload_plugins
type: aggregate
short_description: Load the filter and test plugins once, in the controller, before the workers fork
description:
  - Ansible runs every task of every host in a worker process forked from ansible-playbook. A worker that renders a
    template with a filter first loads every filter plugin (Ansible's and the project's, with all they import), and
    forgets them when it exits, so every task paid for it again - a quarter of the controller's CPU in a pipeline
    run (benchmarks/README.md).
  - Loaded here once, at the playbook's start, the plugins are inherited by every forked worker.
  - Prints nothing and changes no result.
"""

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "preload_plugins"
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_start(self, playbook):
        for loader in (filter_loader, test_loader):
            for _ in loader.all():
                pass
