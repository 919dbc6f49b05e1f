"""The user's registry credentials (MAD's ``credential.json``) on their way into a job: checked on the submitting
host before anything is submitted, and the registry's one entry copied 0600 into the job's private dir, whose path
alone the pipeline sees (the modules hand the password to ``docker login --password-stdin`` on the node).
"""

import os
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry_credentials import (
    CredentialsError,
    credential_for,
    parse_credentials,
    pick_credential,
    private_copy_text,
)
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import write_new_private_file

CREDENTIALS_FILE_NAME = "credential.json"


def checked_credentials_file(path: str | Path, registry: str | None) -> Path:
    """`path` made absolute, once it holds a valid entry for `registry`; SlurmMultiError saying what to fix."""
    path = Path(path).expanduser().absolute()
    if not registry:
        raise SlurmMultiError(
            f"--credentials {path} is the login of registry mode: give --registry too (or drop --credentials)"
        )
    try:
        credential_for(str(path), registry)
    except CredentialsError as exc:
        raise SlurmMultiError(str(exc)) from None
    return path


def default_credentials_file(registry: str | None, directory: str | Path | None = None) -> Path | None:
    """MAD's ``credential.json`` of `directory` (default: the current one) when registry mode is on and the file
    has an entry for the registry; None otherwise (MAD's file may hold only other credentials)."""
    if not registry:
        return None
    path = Path(directory or os.getcwd()).absolute() / CREDENTIALS_FILE_NAME
    if not path.is_file():
        return None
    source = f"the credentials file {path} (MAD's, found in the current directory)"
    try:
        has_entry = pick_credential(parse_credentials(path.read_text(encoding="utf-8"), source), registry, source)
    except (CredentialsError, OSError, UnicodeDecodeError) as exc:
        raise SlurmMultiError(f"{exc}; or give another file with --credentials FILE") from None
    return path if has_entry else None


def write_credentials_copy(private_dir: Path, source: Path, registry: str) -> Path:
    """Copy `source`'s entry for `registry` to a new 0600 ``credential.json`` in `private_dir`; return its path."""
    try:
        credential = credential_for(str(source), registry)
    except CredentialsError as exc:
        raise SlurmMultiError(str(exc)) from None
    return write_new_private_file(Path(private_dir) / CREDENTIALS_FILE_NAME, private_copy_text(credential, str(source)))
