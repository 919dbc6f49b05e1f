"""Every private name of ansible-core that the speed-up layer uses, and the only place that names them: an ImportError
or AttributeError from `controller_names()` means ansible-core changed, and switch.layer_on() turns the layer off."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class ControllerNames(NamedTuple):
    # Ansible's Jinja environment: its `compile` is replaced (preload.CompiledTemplates).
    AnsibleEnvironment: type
    # The context of Ansible's explicit template compiles: whether backslashes are escaped shapes the code.
    TemplateCompileContext: type
    # The collection loader's module: its `_meta_yml_to_dict` ("may be monkeypatched ... to cache") and its package
    # loader's `get_code` are replaced (playbook.install).
    collection_finder: object
    # The class of Ansible's cached AnsiballZ payloads (a dataclass with `zip_data`; preload.keep_payload).
    CachedModule: type


def controller_names() -> ControllerNames:
    """The private names of the controller's parts, each checked as the parts use it; ImportError or AttributeError
    when ansible-core changed one."""
    from ansible._internal._templating._jinja_bits import AnsibleEnvironment, _TemplateCompileContext
    from ansible.executor.module_common import _CachedModule
    from ansible.utils.collection_loader import _collection_finder
    from ansible.vars.manager import VariableManager

    _require(_collection_finder, "_meta_yml_to_dict")
    loader = _require(_collection_finder, "_AnsibleCollectionPkgLoaderBase")
    _require(loader, "get_code")
    _require(loader, "get_filename")
    _require(_TemplateCompileContext, "current")
    _require_fields(_TemplateCompileContext, "escape_backslashes")
    _require_fields(_CachedModule, "zip_data")
    _require(AnsibleEnvironment, "compile")
    # An attribute its __init__ sets (play_inventory): named among the names the constructor stores.
    if "_inventory" not in VariableManager.__init__.__code__.co_names:
        raise AttributeError("ansible.vars.manager.VariableManager keeps no _inventory")
    return ControllerNames(AnsibleEnvironment, _TemplateCompileContext, _collection_finder, _CachedModule)


def play_inventory(play):
    """The inventory of a play's variable manager (module_servers: does the play reach a node through srun?)."""
    return play.get_variable_manager()._inventory


def import_ansiballz_loader() -> None:
    """AnsiballZ's own loader (ansible-core 2.19), which every payload imports: once in the module server, when this
    ansible-core has it (without it each module imports it itself, as in a fresh Python)."""
    try:
        from ansible.module_utils._internal._ansiballz import _loader  # noqa: F401
    except ImportError:
        pass


def _require(owner, name: str):
    value = getattr(owner, name)  # AttributeError names the owner and the name
    if value is None:
        raise AttributeError(f"{getattr(owner, '__name__', owner)}.{name} is None")
    return value


def _require_fields(cls: type, *names: str) -> None:
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name in names:
        if name not in fields:
            raise AttributeError(f"{cls.__module__}.{cls.__qualname__} has no field {name}")
