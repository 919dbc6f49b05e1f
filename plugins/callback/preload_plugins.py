"""Callback: the controller's per-run work done once - the filter and test plugins loaded before any worker forks,
the modules' AnsiballZ payloads kept from one run to the next."""

DOCUMENTATION = r"""
name: preload_plugins
type: aggregate
short_description: Do the controller's per-run work once - plugins loaded before the forks, module payloads kept
description:
  - Ansible runs every task of every host in a worker process forked from ansible-playbook. A worker that renders a
    template with a filter first loads every filter plugin (Ansible's and the project's, with all they import), and
    forgets them when it exits, so every task paid for it again - a quarter of the controller's CPU in a pipeline
    run. Loaded here once, at the playbook's start, the plugins are inherited by every forked worker.
  - Each ansible-playbook also builds every module's AnsiballZ payload anew, parsing the module and every
    module_utils file it imports - another quarter of the controller's CPU, paid again by every node's playbook of a
    pull-mode run. The payloads it built are kept at the playbook's end in the user's own cache
    (C($XDG_CACHE_HOME/slurm-multi/ansiballz), else C(~/.cache/...); a 0700 dir of theirs, else nothing is kept),
    under a key of Ansible's and Python's versions, the checkout and every byte of library/ and module_utils/, and
    handed to the next playbook at its start. A change to any module or module_utils file is a new key; a key no
    playbook has used for a week is removed.
  - A kept payload carries a checked-hash .pyc beside each source, compiled by the controller's Python. A node's
    Python takes one only where its magic and the source's hash match, and compiles the source otherwise; so a node
    on the controller's venv skips the compile, about half of a module's start-up CPU.
  - Prints nothing and changes no result (benchmarks/README.md, "The controller's work per run").
"""

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
import tempfile
import time
import zipfile

from ansible import constants as C
from ansible import release
from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAYLOAD_SOURCES = ("library", "module_utils")
UNUSED_KEY_DAYS = 7


def payload_key(root=ROOT):
    """What every payload built from this checkout depends on: Ansible, Python, the checkout, its modules' bytes."""
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


def own_private_dir(path):
    """``path`` made (0700) or found as this user's own private dir; None when it is anything else."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return None
    mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
    return path if mine else None


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
    """An AnsiballZ zip (base64) with a checked-hash .pyc beside each .py, compiled by this Python.

    zipimport takes a module's .pyc from the zip where its magic is the node's Python's and its hash is the .py's,
    and compiles the .py otherwise - so the payload still runs on any Python, and skips the compile where the node's
    Python is the controller's (a venv on shared storage): about half of a module's start-up CPU.
    """
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


def keep_payload(built, kept):
    """Write Ansible's cached payload ``built`` to ``kept`` with its bytecode added, whole or not at all."""
    with open(built, "rb") as handle:
        payload = pickle.load(handle)  # Ansible's own cache entry (module_common._CachedModule), this user's file
    payload = dataclasses.replace(payload, zip_data=with_bytecode(payload.zip_data))
    # Whole or absent: another playbook may read the dir meanwhile.
    handle, partial = tempfile.mkstemp(dir=os.path.dirname(kept), prefix=".part-")
    with os.fdopen(handle, "wb") as part:
        pickle.dump(payload, part)
    os.replace(partial, kept)


def prune_unused_keys(cache, unused_for=UNUSED_KEY_DAYS * 86400):
    """Remove the payloads of keys no playbook has used for ``unused_for`` seconds (each edit of a module is a key)."""
    now = time.time()
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # pruned by another playbook meanwhile
        if stat.S_ISDIR(info.st_mode) and now - info.st_mtime > unused_for:
            shutil.rmtree(path, ignore_errors=True)


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "preload_plugins"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._kept = None
        self._built = os.path.join(C.DEFAULT_LOCAL_TMP, "ansiballz_cache")

    def v2_playbook_on_start(self, playbook):
        for loader in (filter_loader, test_loader):
            for _ in loader.all():
                pass
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = own_private_dir(os.path.join(home, "slurm-multi", "ansiballz"))
        self._kept = cache and own_private_dir(os.path.join(cache, payload_key()))
        if self._kept:
            os.utime(self._kept)  # in use: kept from pruning
            prune_unused_keys(cache)
            os.makedirs(self._built, exist_ok=True)
            for name in os.listdir(self._kept):
                shutil.copy2(os.path.join(self._kept, name), os.path.join(self._built, name))

    def v2_playbook_on_stats(self, stats):
        if not self._kept or not os.path.isdir(self._built):
            return
        for name in os.listdir(self._built):
            kept = os.path.join(self._kept, name)
            if name.endswith((".lock", "-part")) or os.path.exists(kept):
                continue
            keep_payload(os.path.join(self._built, name), kept)
