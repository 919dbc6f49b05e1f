"""Registry credentials: MAD's ``credential.json``, one entry picked for a registry, and a `docker login` that
leaves nothing behind (secret on stdin, a fresh 0700 Docker config dir removed after). Only the picked entry is
validated, strictly; errors name the file, the key and the field, never a secret."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from typing import Dict, Iterator, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets, node_local_tmp_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.safe_files import read_private_text
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

DOCKER_HUB = "docker.io"
# The names users give Docker Hub in credential.json (MAD's own key is "dockerhub").
DOCKER_HUB_ALIASES = ("dockerhub", "docker.io", "index.docker.io", "registry-1.docker.io", "hub.docker.com")
SECRET_FIELDS = ("password", "token")
KNOWN_FIELDS = ("username", "repository") + SECRET_FIELDS
# The job's copy of an entry records which file of the user's it came from, for error messages on the nodes.
SOURCE_KEY = "slurm-multi:copied-from"
DEFAULT_LOGIN_TIMEOUT = 120.0


class CredentialsError(UserError):
    """A credentials file, entry or login that cannot be used; the message never holds a secret."""


class RegistryCredential:
    """One registry's login: the credential.json key it came from, the username and the secret (never printed)."""

    __slots__ = ("key", "username", "secret", "secret_field")

    def __init__(self, key: str, username: str, secret: str, secret_field: str):
        self.key = key
        self.username = username
        self.secret = secret
        self.secret_field = secret_field

    def __repr__(self) -> str:
        return f"RegistryCredential(key={self.key!r}, username={self.username!r}, {self.secret_field}=********)"


def registry_host(registry: str) -> str:
    """The host a registry or image reference lives on; docker.io for none or a Docker Hub alias."""
    first = registry.strip().split("://", 1)[-1].split("/", 1)[0]
    # Docker's own rule: a first component is a host when it holds `.` or `:`, or is `localhost`.
    is_host = "." in first or ":" in first or first == "localhost"
    return _key_host(first) if is_host else DOCKER_HUB


def _key_host(key: str) -> str:
    """The host a credential.json key names (its scheme and path ignored; Docker Hub's aliases -> docker.io)."""
    first = key.strip().split("://", 1)[-1].split("/", 1)[0].lower()
    return DOCKER_HUB if first in DOCKER_HUB_ALIASES else first


def parse_credentials(text: str, source: str) -> dict:
    """The credentials file's top-level object; CredentialsError for text that is not a JSON object."""
    try:
        data = json.loads(text)
    except ValueError as error:
        # json's message names the position only (line, column), never the text around it.
        position = str(error).rsplit(": ", 1)[-1] if ": " in str(error) else str(error)
        raise CredentialsError(f"{source} is not valid JSON ({position}): fix its syntax") from None
    if not isinstance(data, dict):
        raise CredentialsError(
            f"{source} holds a JSON {type(data).__name__}, not an object: MAD's credential.json maps registry "
            'names to logins, e.g. {"localhost:5000": {"username": "me", "password": "..."}}'
        )
    return data


def read_credentials_file(path: str, private: bool = True) -> dict:
    """The credentials file's top-level object; with `private`, refused unless only its owner, you, may read it."""
    what = f"the credentials file {path}"
    text = read_private_text(path, what, CredentialsError, "change the passwords", private)
    return parse_credentials(text, f"the credentials file {path}")


def _matching_keys(credentials: Mapping, registry: str) -> list:
    if registry in credentials and registry != SOURCE_KEY:
        return [registry]
    host = registry_host(registry)
    return [key for key in credentials if key != SOURCE_KEY and _key_host(str(key)) == host]


def validate_entry(key: str, entry, source: str) -> RegistryCredential:
    """The entry `key` of a credentials file as a RegistryCredential; CredentialsError naming what to fix."""
    where = f"{source}, entry {key!r}"
    if not isinstance(entry, dict):
        raise CredentialsError(
            f'{where} is a JSON {type(entry).__name__}, not an object: write it as {{"username": "...", '
            '"password": "..."}'
        )
    unknown = sorted(str(field) for field in entry if field not in KNOWN_FIELDS)
    if unknown:
        raise CredentialsError(
            f"{where} has unknown field(s) {', '.join(unknown)}: a registry login takes username and password "
            "(or token), and MAD's repository; fix the spelling or remove them"
        )
    username = entry.get("username")
    if not isinstance(username, str) or not username.strip():
        problem = "is missing" if "username" not in entry else "is empty or not a string"
        raise CredentialsError(f"{where}: username {problem}: give the registry user name as a string")
    given = [field for field in SECRET_FIELDS if field in entry]
    if not given:
        raise CredentialsError(f"{where}: password is missing: give password (or token) as a string")
    if len(given) > 1:
        raise CredentialsError(f"{where} has both password and token: keep the one the registry accepts")
    field = given[0]
    secret = entry[field]
    if not isinstance(secret, str) or not secret:
        raise CredentialsError(f"{where}: {field} is empty or not a string: give it as a non-empty JSON string")
    if any(char in secret for char in "\r\n\0"):
        # `--password-stdin` reads one line: a line break would cut the secret short.
        raise CredentialsError(f"{where}: {field} holds a line break or NUL byte, which docker login cannot take")
    if "repository" in entry and not isinstance(entry["repository"], str):
        raise CredentialsError(f"{where}: repository must be a string")
    return RegistryCredential(str(key), username.strip(), secret, field)


def pick_credential(credentials: Mapping, registry: str, source: str) -> Optional[RegistryCredential]:
    """The validated entry for `registry` (a key equal to it, else the one key of its host), or None."""
    keys = _matching_keys(credentials, registry)
    if len(keys) > 1:
        raise CredentialsError(
            f"{source} has several entries for registry {registry_host(registry)} ({', '.join(map(repr, keys))}): "
            "keep one of them"
        )
    return validate_entry(keys[0], credentials[keys[0]], source) if keys else None


def missing_entry_error(credentials: Mapping, registry: str, source: str) -> CredentialsError:
    """The error for a file that has no entry for `registry`: the keys it has, and the key to add."""
    host = registry_host(registry)
    key = "dockerhub" if host == DOCKER_HUB else host
    present = ", ".join(repr(str(k)) for k in credentials if k != SOURCE_KEY) or "none"
    return CredentialsError(
        f"{source} has no entry for registry {host} (its entries: {present}): add "
        f'"{key}": {{"username": "...", "password": "..."}}'
    )


def credential_for(path: str, registry: str) -> RegistryCredential:
    """The entry of the credentials file at `path` for `registry`; CredentialsError if it has none or it is bad."""
    return _credential_and_source(path, registry)[0]


def _credential_and_source(path: str, registry: str):
    credentials = read_credentials_file(path)
    source = _source_name(credentials, path)
    credential = pick_credential(credentials, registry, source)
    if credential is None:
        raise missing_entry_error(credentials, registry, source)
    return credential, source


def _source_name(credentials: Mapping, path: str) -> str:
    copied_from = credentials.get(SOURCE_KEY)
    if isinstance(copied_from, str) and copied_from:
        return f"the credentials file {copied_from} (the job's copy: {path})"
    return f"the credentials file {path}"


def private_copy_text(credential: RegistryCredential, source_path: str) -> str:
    """The job's copy of one entry: MAD's shape, plus the file it came from (for messages on the nodes)."""
    entry = {"username": credential.username, credential.secret_field: credential.secret}
    return json.dumps({credential.key: entry, SOURCE_KEY: source_path}, indent=2) + "\n"


def docker_login(
    credential: RegistryCredential,
    registry: str,
    docker_config: str,
    docker_host: Optional[str] = None,
    source: str = "the credentials file",
) -> None:
    """`docker login` to `registry`'s host as `credential`, its secret on stdin, storing into `docker_config`."""
    host = registry_host(registry)
    # Docker Hub is the CLI's default server: naming it would store the login under another key.
    server = [] if host == DOCKER_HUB else [host]
    args = ["login", "--username", credential.username, "--password-stdin"] + server
    try:
        completed = run_docker(
            args,
            timeout=DEFAULT_LOGIN_TIMEOUT,
            input=credential.secret + "\n",
            host=docker_host,
            check=False,
            extra_env={"DOCKER_CONFIG": docker_config},
        )
    except DockerError as error:
        raise CredentialsError(
            mask_secrets(f"docker login to registry {host} failed: {error}", [credential.secret])
        ) from None
    if completed.returncode != 0:
        said = mask_secrets(completed.stderr.strip()[-1000:], [credential.secret])
        raise CredentialsError(
            f"docker login to registry {host} as {credential.username!r} failed (exit {completed.returncode}): "
            f"{said}. Check the username and {credential.secret_field} of entry {credential.key!r} in {source}, "
            f"and that this node reaches the registry {host}"
        )


@contextlib.contextmanager
def logged_in(
    credentials_file: Optional[str],
    registry: str,
    docker_host: Optional[str] = None,
    on_secret=None,
    base_dir: Optional[str] = None,
) -> Iterator[Optional[Dict[str, str]]]:
    """Logged in to `registry` for the block: yields the ``DOCKER_CONFIG`` environment additions, or None without a
    credentials file; `on_secret(secret)` is called before anything can fail with it at hand."""
    if not credentials_file:
        yield None
        return
    credential, source = _credential_and_source(credentials_file, registry)
    if on_secret is not None:
        on_secret(credential.secret)
    config_dir = tempfile.mkdtemp(prefix="slurm-multi-docker-", dir=base_dir or node_local_tmp_dir())
    try:
        docker_login(credential, registry, config_dir, docker_host, source)
        yield {"DOCKER_CONFIG": config_dir}
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)
