"""``slurm-multi-playbook``: ansible-playbook, with two of its start-up costs paid once per user, not per run.

ansible-core's builtin routing file is parsed once and kept in the user's cache (through the hook ansible-core leaves
for that, ``_meta_yml_to_dict``), and the collection loader takes Python's bytecode cache rather than compiling every
module it imports. While the speed-up layer is off (switch.layer_on()) every call goes to ansible-core's own code;
any argument ansible-playbook takes, this takes (docs/speedup.md).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
from importlib.machinery import SourceFileLoader

from slurm_multi.speedup.switch import layer_on, private_names

CACHE_NAME = "routing"


def _user_cache() -> int | None:
    """A descriptor of the user's private dir for kept routing files (0700, theirs, in dirs no one else can swap),
    made if missing; None when it cannot be."""
    # Imported when first asked, through the collection loader ansible-playbook has installed by then.
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import open_private_dir

    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return open_private_dir(os.path.join(home, "slurm-multi", CACHE_NAME))


def kept_routing(parse):
    """``parse`` (ansible-core's ``_meta_yml_to_dict``) with its result kept per content: a file parsed once."""

    def meta_yml_to_dict(yaml_string_data, content_id):
        folder = _user_cache()
        if folder is None:
            return parse(yaml_string_data, content_id)
        try:
            return _kept_or_parsed(folder, parse, yaml_string_data, content_id)
        finally:
            os.close(folder)

    return meta_yml_to_dict


def _kept_or_parsed(folder: int, parse, yaml_string_data, content_id):
    """The routing kept in ``folder`` (a dir's descriptor: read where it was checked) for this content, else parsed
    and kept there."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_file, replace_in_dir

    data = yaml_string_data.encode() if isinstance(yaml_string_data, str) else bytes(yaml_string_data)
    name = hashlib.sha256(b"%d\0" % marshal.version + data).hexdigest()[:32] + ".marshal"
    try:
        routing = marshal.loads(read_file(name, dir_fd=folder))
        if isinstance(routing, dict):
            return routing
    except (OSError, EOFError, ValueError, TypeError):
        pass  # not kept yet, or damaged: parsed and written again
    routing = parse(yaml_string_data, content_id)
    try:
        encoded = marshal.dumps(routing)
    except ValueError:
        return routing  # not plain data (another implementation's result): nothing to keep
    # Whole or absent: another playbook may read it meanwhile. A cache that cannot be written costs the parse.
    try:
        replace_in_dir(folder, name, encoded)
    except OSError:
        pass
    return routing


def cached_get_code(get_code):
    """Ansible's collection loader's ``get_code`` through Python's bytecode cache for a module that is a source file."""

    def through_pycache(loader, fullname):
        if not loader._compiled_code:
            filename = loader.get_filename(fullname)
            if filename and filename.endswith(".py") and os.path.isfile(filename):
                loader._compiled_code = SourceFileLoader(fullname, filename).get_code(fullname)
        return get_code(loader, fullname)

    return through_pycache


def install() -> None:
    """Put both caches into ansible-core's collection loader, before any playbook code runs; each call goes to them
    only while the layer is on. An ansible-core without the names they replace gets nothing (layer_on() says so)."""
    names = private_names()
    if names is None:
        return
    finder = names.collection_finder
    finder._meta_yml_to_dict = _while_on(kept_routing(finder._meta_yml_to_dict), finder._meta_yml_to_dict)
    loader = finder._AnsibleCollectionPkgLoaderBase
    loader.get_code = _while_on(cached_get_code(loader.get_code), loader.get_code)


def _while_on(cached, plain):
    """``cached`` while the layer is on, ``plain`` (ansible-core's own) before Ansible read its command line (the
    setting may be in its -e) and when the layer is off."""

    def chosen(*args):
        from ansible import context

        return (cached if context.CLIARGS and layer_on() else plain)(*args)

    return chosen


def main() -> None:
    # ansible-playbook's own imports first, as it makes them (they hold every name install() checks).
    from ansible.cli.playbook import main as ansible_playbook

    install()
    sys.exit(ansible_playbook())
