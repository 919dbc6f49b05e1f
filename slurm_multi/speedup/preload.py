"""The preload_plugins callback's work (plugins/callback/preload_plugins.py is the file Ansible loads): the
controller's per-run work done once - the filter and test plugins loaded before any worker forks, the modules'
AnsiballZ payloads and the templates' compiled code kept from one run to the next (docs/speedup.md). Does nothing
when the speed-up layer is off (switch.layer_on())."""

import base64
import dataclasses
import hashlib
import importlib.util
import io
import marshal
import os
import pickle
import shutil
import stat
import sys
import time
import types
import zipfile

import jinja2
from ansible import constants as C
from ansible import release
from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import (
    open_private_dir,
    read_file,
    replace_in_dir,
)
from slurm_multi.speedup.switch import layer_on, private_names

# The modules' sources in a checkout and in a built collection (its library/ as plugins/modules).
PAYLOAD_SOURCES = ("library", "module_utils", "plugins/modules", "plugins/module_utils")
# One of the project's filters by its full name, as the roles call them: loading it imports every filter file of the
# collection, which the forked workers then find loaded (Jinja2Loader.all() loads configured folders, no collection).
A_PROJECT_FILTER = "slurm_multi.pipeline.pipeline_default"
UNUSED_KEY_DAYS = 7


def payload_key(root=None):
    """What every payload built from the Ansible content at ``root`` (None: the package's) depends on."""
    if root is None:
        from slurm_multi.paths import project_root

        root = str(project_root())
    digest = hashlib.sha256(f"{release.__version__}\0{sys.version}\0{root}\0".encode())
    for source in PAYLOAD_SOURCES:
        for folder, dirs, files in sorted(os.walk(os.path.join(root, source))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as handle:
                        digest.update(handle.read())
    return digest.hexdigest()[:32]


def user_cache():
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "slurm-multi")


def checked_pyc(source, filename):
    """A .pyc of ``source`` that its importer trusts only while the source's hash matches (PEP 552, checked)."""
    code = compile(source, filename, "exec", dont_inherit=True)
    return (
        importlib.util.MAGIC_NUMBER
        + (0b11).to_bytes(4, "little")
        + importlib.util.source_hash(source)
        + marshal.dumps(code)
    )


def with_bytecode(zip_data):
    """An AnsiballZ zip (base64) with a checked-hash .pyc beside each .py, compiled by this Python: zipimport uses it
    only where the node's Python is this one, and compiles the .py elsewhere."""
    plain = zipfile.ZipFile(io.BytesIO(base64.b64decode(zip_data)))
    output = io.BytesIO()
    with zipfile.ZipFile(output, "w") as compiled:
        for entry in plain.infolist():
            source = plain.read(entry)
            compiled.writestr(entry, source)
            if entry.filename.endswith(".py"):
                bytecode = zipfile.ZipInfo(entry.filename + "c", entry.date_time)
                bytecode.compress_type = entry.compress_type
                compiled.writestr(bytecode, checked_pyc(source, entry.filename))
    return base64.b64encode(output.getvalue())


def keep_payload(built, kept, name):
    """Write Ansible's cached payload ``built``, its bytecode added, as ``name`` in the dir open as ``kept``."""
    with open(built, "rb") as handle:
        payload = pickle.load(handle)  # Ansible's own cache entry (module_common._CachedModule), this user's file
    payload = dataclasses.replace(payload, zip_data=with_bytecode(payload.zip_data))
    replace_in_dir(kept, name, pickle.dumps(payload))


def prune_unused_keys(cache, unused_for=UNUSED_KEY_DAYS * 86400):
    """Remove from the dir open as ``cache`` the payloads of keys unused for ``unused_for`` seconds."""
    now = time.time()
    for name in os.listdir(cache):
        try:
            info = os.stat(name, dir_fd=cache, follow_symlinks=False)
        except FileNotFoundError:
            continue  # pruned by another playbook meanwhile
        if stat.S_ISDIR(info.st_mode) and now - info.st_mtime > unused_for:
            shutil.rmtree(name, dir_fd=cache, ignore_errors=True)


# What shapes the code Jinja generates from a template's source, besides the source: the lexer's and code
# generator's settings of the environment (a `#jinja2:` override changes some of them).
CODE_SETTINGS = (
    "block_start_string", "block_end_string", "variable_start_string", "variable_end_string", "comment_start_string",
    "comment_end_string", "line_statement_prefix", "line_comment_prefix", "trim_blocks", "lstrip_blocks",
    "newline_sequence", "keep_trailing_newline", "optimized", "autoescape", "is_async",
)  # fmt: skip


def code_settings(environment):
    return repr(
        (
            [getattr(environment, name) for name in CODE_SETTINGS],
            sorted(environment.extensions),
            type(environment).code_generator_class.__qualname__,
            getattr(environment.finalize, "__qualname__", None),
        )
    )


class CompiledTemplates:
    """Jinja's code for each template source (it depends only on the source and the environment's settings), kept
    in a private dir of the user's and read before the workers fork, so each source is compiled once."""

    def __init__(self, folder, names=None):
        # The dir's descriptor (safe_files.open_private_dir), kept open: this process and its forks read and write
        # the dir that was checked, whatever is renamed meanwhile.
        self.folder = folder
        # Ansible's Jinja environment and the context of its explicit compiles (ansible_private).
        self.names = names or private_names()
        self.settings = code_settings(self.names.AnsibleEnvironment())  # also makes the lexer every fork would make
        self.codes = {}
        for name in os.listdir(folder):
            try:
                code = marshal.loads(read_file(name, dir_fd=folder))
            except (OSError, EOFError, ValueError, TypeError):
                continue  # unreadable: compiled and written again on its first use
            if isinstance(code, types.CodeType):
                self.codes[name] = code

    def compile(self, compile_source, environment, source, name=None, filename=None, raw=False, defer_init=False):
        if not isinstance(source, str) or name or filename or raw or defer_init:
            return compile_source(environment, source, name, filename, raw, defer_init)
        if code_settings(environment) != self.settings:
            return compile_source(environment, source)
        context = self.names.TemplateCompileContext.current(optional=True)
        escaped = bool(context and context.escape_backslashes)
        key = hashlib.sha256(f"{escaped}\0{source}".encode()).hexdigest()
        code = self.codes.get(key)
        if code is None:
            code = self.codes[key] = compile_source(environment, source)
            self._keep(key, code)
        return code

    def _keep(self, key, code):
        try:  # whole or absent: other workers read and write the dir meanwhile
            replace_in_dir(self.folder, key, marshal.dumps(code))
        except OSError:
            pass  # not kept: compiled again by the next playbook

    def install(self):
        """Every Ansible environment compiles through this cache, in this process and the workers it forks."""
        compile_source = jinja2.Environment.compile

        def compile_cached(environment, source, name=None, filename=None, raw=False, defer_init=False):
            return self.compile(compile_source, environment, source, name, filename, raw, defer_init)

        self.names.AnsibleEnvironment.compile = compile_cached


def kept_key_dir(cache, key):
    """A descriptor of the private dir of ``key`` in the user's ``cache``, marked as in use (old keys pruned); None
    when either dir is not private to the user."""
    folder = open_private_dir(os.path.join(user_cache(), cache))
    if folder is None:
        return None
    try:
        kept = open_private_dir(key, dir_fd=folder)
        if kept is not None:
            os.utime(kept)  # in use: kept from pruning
            prune_unused_keys(folder)
        return kept
    finally:
        os.close(folder)


def templates_key():
    """What the code compiled from a template depends on besides its source and settings: the versions."""
    return hashlib.sha256(f"{release.__version__}\0{jinja2.__version__}\0{sys.version}\0".encode()).hexdigest()[:32]


class PreloadPlugins(CallbackBase):
    """The callback; plugins/callback/preload_plugins.py names it CallbackModule and gives its CONTENT_ROOT."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "preload_plugins"
    CALLBACK_NEEDS_ENABLED = True
    # The Ansible content the callback file is part of: its library/ and module_utils/ are what payloads are built
    # from (empty: the package's, slurm_multi.paths).
    CONTENT_ROOT = ""

    def __init__(self):
        super().__init__()
        self._kept = None
        # On load: Ansible has read its command line, and no worker has forked yet.
        self._on = layer_on()
        if not self._on:
            return
        self._built = os.path.join(C.DEFAULT_LOCAL_TMP, "ansiballz_cache")
        # Before the first template the play renders.
        kept = kept_key_dir("templates", templates_key())
        if kept is not None:
            CompiledTemplates(kept).install()

    def v2_playbook_on_start(self, playbook):
        if not self._on:
            return
        for loader in (filter_loader, test_loader):
            for _ in loader.all():
                pass
        filter_loader.get(A_PROJECT_FILTER)
        self._kept = kept_key_dir("ansiballz", payload_key(self.CONTENT_ROOT or None))
        if self._kept is not None:
            os.makedirs(self._built, exist_ok=True)
            for name in os.listdir(self._kept):
                if not name.startswith(".part-"):
                    with open(os.path.join(self._built, name), "wb") as built:
                        built.write(read_file(name, dir_fd=self._kept))

    def v2_playbook_on_stats(self, stats):
        if self._kept is None or not os.path.isdir(self._built):
            return
        kept = set(os.listdir(self._kept))
        for name in os.listdir(self._built):
            if name.endswith((".lock", "-part")) or name in kept:
                continue
            keep_payload(os.path.join(self._built, name), self._kept, name)
