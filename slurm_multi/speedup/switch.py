"""Whether the speed-up layer works: the `speedup` setting, then ansible-core's private names; decided once in each
ansible-playbook (`layer_on()`) and handed on in $SLURM_MULTI_SPEEDUP, which is all a node's parts read (`off_in()`)."""

from __future__ import annotations

import os

SETTING = "speedup"
# The setting's environment variable (module_utils/job/defaults.py names it; the bin scripts in this folder read it).
ENV = "SLURM_MULTI_SPEEDUP"
# Ansible's words for false (ansible.module_utils.parsing.convert_bool), as the environment spells them.
OFF_WORDS = ("0", "n", "no", "off", "f", "false")

_decided: bool | None = None
_deciding = False
# ansible_private.controller_names(), once: the names, or what was missing.
_names = None
_missing: Exception | None = None


def off_in(environ=os.environ) -> bool:
    """Whether $SLURM_MULTI_SPEEDUP turns the layer off: what a part outside ansible-playbook goes by."""
    return environ.get(ENV, "").lower() in OFF_WORDS


def layer_on() -> bool:
    """Whether the layer works in this ansible-playbook: decided at the first call, which must come after Ansible read
    its command line (its -e), and exported in $SLURM_MULTI_SPEEDUP. A call made while deciding (the routing file
    parsed for an import the decision makes) gets False: that one parse is Ansible's own."""
    global _decided, _deciding
    if _decided is None:
        if _deciding:
            return False
        _deciding = True
        try:
            warning = _why_off()
        finally:
            _deciding = False
        _decided = warning is None
        os.environ[ENV] = "1" if _decided else "0"
        if warning:
            from ansible.utils.display import Display

            Display().warning(warning)
    return _decided


def _why_off() -> str | None:
    """None when the layer works; else the warning to show, or "" when the setting turned it off as asked."""
    from ansible.module_utils.parsing.convert_bool import boolean

    value, source = setting_value()
    try:
        if not boolean(value, strict=True):
            return ""
    except TypeError:
        return (
            f"the setting {SETTING} is {value!r} ({source}), which is neither true nor false: the speed-up layer is "
            f"off for this playbook (give {SETTING}: true or false; docs/speedup.md)"
        )
    if private_names() is None:
        from ansible.release import __version__

        return (
            f"slurm-multi's speed-up layer steps aside: ansible-core {__version__} lacks a private name it uses "
            f"({type(_missing).__name__}: {_missing}); this playbook runs on plain Ansible (docs/speedup.md)"
        )
    return None


def private_names():
    """ansible-core's private names the layer uses (ansible_private.controller_names()), or None when this
    ansible-core lacks or changed one: the one place their absence is caught."""
    global _names, _missing
    if _names is None and _missing is None:
        from slurm_multi.speedup.ansible_private import controller_names

        try:
            _names = controller_names()
        except (ImportError, AttributeError) as missing:
            _missing = missing
    return _names


def setting_value(environ=os.environ) -> tuple:
    """(value, source) of the setting as this ansible-playbook gets it: its -e, else the last of the site file, the
    user's file and $SLURM_MULTI_SPEEDUP that gives it, else the default."""
    from ansible import context

    if context.CLIARGS.get("extra_vars"):
        from ansible.errors import AnsibleError
        from ansible.parsing.dataloader import DataLoader
        from ansible.utils.vars import load_extra_vars

        try:
            # Ansible keeps what this reads and takes it when it reads its -e itself: read once.
            extra_vars = load_extra_vars(DataLoader())
        except AnsibleError:
            extra_vars = {}  # Ansible reports a bad -e itself, when it reads them
        if SETTING in extra_vars:
            return extra_vars[SETTING], "-e"
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import settings_layers
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

    try:
        layers, _ = settings_layers(environ)
    except UserError:  # a settings file the inventory refuses, naming it: the job stops there anyway
        layers = [(f"${ENV}", {SETTING: environ[ENV]})] if environ.get(ENV) else []
    for source, given in reversed(layers):
        if SETTING in given:
            return given[SETTING], source
    return SETTING_DEFAULTS[SETTING], "default"
