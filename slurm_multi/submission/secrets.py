"""The user's ``MAD_SECRETS_*`` on their way into a job: out of every environment, into one 0600 file in the job's
private dir, whose path alone (``secrets_file``) the pipeline sees; the run module gives the values to the container
alone.
"""

from collections.abc import Mapping
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import (
    SECRET_PREFIX,
    SecretsError,
    format_secrets_file,
)
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import write_new_private_file

SECRETS_FILE_NAME = "secrets.env"


def split_secrets(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(secrets, environment without them)``: the ``MAD_SECRETS_*`` entries of ``environ`` and everything else."""
    secrets = {name: value for name, value in environ.items() if name.startswith(SECRET_PREFIX)}
    rest = {name: value for name, value in environ.items() if not name.startswith(SECRET_PREFIX)}
    return secrets, rest


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` without any ``MAD_SECRETS_*`` variable."""
    return split_secrets(environ)[1]


def secrets_file_text(secrets: Mapping[str, str]) -> str:
    """The secrets file's text, or SecretsError naming the variable that cannot be passed (too short, or holding a
    line boundary the file's reader would split on), never its value."""
    try:
        return format_secrets_file(dict(sorted(secrets.items())))
    except SecretsError as exc:
        raise SecretsError(f"cannot pass the job's secrets: {exc}") from None


def user_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``MAD_SECRETS_*`` of ``environ`` (this process's), refused when the secrets file cannot carry one."""
    secrets, _ = split_secrets(environ)
    try:
        secrets_file_text(secrets)
    except SecretsError as exc:
        raise SlurmMultiError(str(exc)) from None
    return secrets


def write_secrets_file(private_dir: Path, secrets: Mapping[str, str]) -> Path:
    """Write ``secrets`` as ``KEY=VALUE`` lines to a new 0600 ``secrets.env`` in ``private_dir``; return its path.
    What the format cannot carry is refused (`secrets_file_text`) before the file exists."""
    content = secrets_file_text(secrets)
    return write_new_private_file(Path(private_dir) / SECRETS_FILE_NAME, content)
