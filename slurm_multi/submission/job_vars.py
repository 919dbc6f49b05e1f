"""The job's vars file: what the pipeline reads reaches Ansible as extra vars from a JSON file, as data.

Every string is marked ``{"__ansible_unsafe": ...}``: ansible-core 2.19 trusts strings of ``-e @file`` as
templates, and a model argument such as ``{{ lookup('pipe', 'id') }}`` must stay the literal text the user gave.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import write_new_private_file

VARS_FILE_NAME = "vars.json"
UNSAFE_MARKER = "__ansible_unsafe"


def mark_unsafe(value: Any) -> Any:
    """``value`` with every string wrapped as ``{"__ansible_unsafe": string}``: Ansible reads it, never templates it."""
    if isinstance(value, str):
        return {UNSAFE_MARKER: value}
    if isinstance(value, Mapping):
        return {str(key): mark_unsafe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_unsafe(item) for item in value]
    return value


def unmark_unsafe(value: Any) -> Any:
    """The inverse of `mark_unsafe`."""
    if isinstance(value, Mapping):
        if set(value) == {UNSAFE_MARKER}:
            return value[UNSAFE_MARKER]
        return {key: unmark_unsafe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unmark_unsafe(item) for item in value]
    return value


def write_job_vars(path: Path, job_vars: Mapping[str, Any]) -> None:
    """Write the job's extra vars to a new 0600 JSON file, every string marked unsafe."""
    write_new_private_file(path, json.dumps(mark_unsafe(dict(job_vars)), indent=2, sort_keys=True) + "\n")


def read_job_vars(path: Path) -> dict[str, Any]:
    """The job's extra vars as plain values."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SlurmMultiError(f"cannot read the job's vars file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SlurmMultiError(f"the job's vars file {path} does not hold a JSON object")
    return unmark_unsafe(data)
