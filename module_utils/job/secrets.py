"""The job's secrets (``MAD_SECRETS_*``) on their way into a model container, and nowhere else (docs/secrets.md).

They reach ``docker run`` through a 0600 env file on node-local storage, never argv. `mask_secrets` masks secret
values only (``OMP_NUM_THREADS=4`` must not mask every ``4``). Errors name the file, line and key, never a value."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, Iterator, List, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_private_text
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

SECRET_PREFIX = "MAD_SECRETS_"
MASK = "********"
# Shorter secrets are refused: masking "4" or "true" would replace every such string in the log, perf lines too.
MIN_SECRET_LENGTH = 8
# Every character `str.splitlines` (the reader) ends a line at; "\r\n" is two of them.
LINE_BOUNDARIES = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SecretsError(UserError):
    """The secrets file or the container environment cannot be used; the message never holds a secret value."""


def read_secrets_file(path: str) -> Dict[str, str]:
    """The ``MAD_SECRETS_*`` entries of the job's secrets file, refused unless it is a regular file of the current
    user's that grants group and others nothing: a secret other users could read (or replace) is already leaked."""
    text = read_private_text(path, f"the secrets file {path}", SecretsError, "rotate the secrets")
    return parse_secrets(text, source=path)


def parse_secrets(text: str, source: str = "secrets file") -> Dict[str, str]:
    """``KEY=VALUE`` lines to a dict, accepting only ``MAD_SECRETS_*`` keys (see the module docstring)."""
    secrets = {}  # type: Dict[str, str]
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _ENV_NAME.match(key):
            raise SecretsError(f"{source}, line {number}: expected KEY=VALUE with a variable name as KEY")
        if not key.startswith(SECRET_PREFIX):
            raise SecretsError(
                f"{source}, line {number}: {key} is not a {SECRET_PREFIX}* name; only {SECRET_PREFIX}* "
                "secrets are accepted there (put other variables in docker_env_vars)"
            )
        check_secret_value(key, value, f"{source}, line {number}: ")
        secrets[key] = value
    return secrets


def check_secret_value(name: str, value: str, where: str = "") -> None:
    """Refuse a secret too short to be masked safely (`MIN_SECRET_LENGTH`); the message names it, never its value."""
    if len(value) < MIN_SECRET_LENGTH:
        raise SecretsError(
            f"{where}the secret {name} is {len(value)} character(s) long, shorter than {MIN_SECRET_LENGTH}: "
            "masking so short a value would shred the logs (every occurrence of it becomes ********). "
            f"Use a real secret of at least {MIN_SECRET_LENGTH} characters, or unset {name} and pass a value that "
            "is not secret through docker_env_vars"
        )


def format_secrets_file(secrets: Mapping[str, str]) -> str:
    """The secrets file text for ``secrets`` (``MAD_SECRETS_*`` names only), refusing what `parse_secrets` would
    read back differently: a value holding a line boundary (`LINE_BOUNDARIES`) or a NUL byte, or one too short."""
    lines = []
    for name, value in secrets.items():
        if not name.startswith(SECRET_PREFIX) or not _ENV_NAME.match(name):
            raise SecretsError(f"{name!r} is not a {SECRET_PREFIX}* variable name")
        check_secret_value(name, value)
        if any(char in value for char in LINE_BOUNDARIES + "\0"):
            raise SecretsError(
                f"the value of {name} holds a line break, another line boundary (\\v, \\f, \\x1c-\\x1e, \\x85, "
                "U+2028, U+2029) or a NUL byte, which the secrets file cannot carry: pass it without them "
                "(e.g. base64-encoded)"
            )
        lines.append(f"{name}={value}\n")
    return "".join(lines)


def secret_forms(secret_values: Iterable[str]) -> List[str]:
    """What a secret looks like in output: its value, and the base64 it encodes to at any offset, longest first (a form
    that contains another is masked whole): ``curl -v`` prints ``Authorization: Basic <base64 of user:password>``."""
    forms = set()
    for value in secret_values:
        if not value:
            continue
        forms.add(value)
        raw = value.encode("utf-8")
        for offset in range(3):
            encoded = base64.b64encode(b"\0" * offset + raw).decode("ascii")
            # The first group holds the offset's bytes, and the last, unless the value ends the encoded data (then
            # it is padded), whatever follows: those characters are not the value's alone.
            start = 4 if offset else 0
            for form in (encoded[start:], encoded[start : 4 * ((offset + len(raw)) // 3)]):
                if len(form) >= MIN_SECRET_LENGTH:
                    forms.add(form)
    return sorted(forms, key=len, reverse=True)


def mask_secrets(text: str, secret_values: Iterable[str]) -> str:
    """``text`` with every occurrence of a secret value, or of its base64 form, replaced by ``********`` (give it
    secret values only: every occurrence of each is replaced)."""
    for form in secret_forms(secret_values):
        text = text.replace(form, MASK)
    return text


class SecretMasker:
    """Masks secrets (`secret_forms`) in output read in chunks; a chunk that does not end a line keeps back its last
    bytes, which may begin a secret that the next chunk ends."""

    def __init__(self, secret_values: Iterable[str]):
        self._forms = [form.encode("utf-8") for form in secret_forms(secret_values)]
        self._held = max((len(form) for form in self._forms), default=1) - 1
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The masked bytes of ``chunk`` that can be written now."""
        data = self._mask(self._pending + chunk)
        if data.endswith(b"\n") or not self._held:
            self._pending = b""
            return data
        cut = max(0, len(data) - self._held)
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """What is still held back, masked: call it at the end of the output."""
        data, self._pending = self._mask(self._pending), b""
        return data

    def _mask(self, data: bytes) -> bytes:
        for form in self._forms:
            data = data.replace(form, MASK.encode())
        return data


def node_local_tmp_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where node-local private files go: /dev/shm (memory, never on disk) when usable, else $TMPDIR."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return (environ if environ is not None else os.environ).get("TMPDIR") or tempfile.gettempdir()


def format_env_file(environment: Mapping[str, str]) -> str:
    """The ``docker run --env-file`` text for an environment (one ``NAME=value`` per line, taken literally)."""
    lines = []
    for name, value in environment.items():
        if not _ENV_NAME.match(name):
            raise SecretsError(f"{name!r} is not a valid environment variable name")
        if "\n" in value or "\r" in value or "\0" in value:
            raise SecretsError(f"the value of {name} holds a line break or NUL byte, which an env file cannot carry")
        lines.append(f"{name}={value}\n")
    return "".join(lines)


@contextlib.contextmanager
def container_env_file(environment: Mapping[str, str], base_dir: Optional[str] = None) -> Iterator[str]:
    """A 0600 env file in a fresh 0700 dir on node-local storage, removed when the block ends, whatever happens."""
    content = format_env_file(environment)
    private_dir = tempfile.mkdtemp(prefix="slurm-multi-env-", dir=base_dir or node_local_tmp_dir())
    try:
        path = os.path.join(private_dir, "container.env")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as env_file:
            env_file.write(content)
        yield path
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)
