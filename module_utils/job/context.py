"""The run context: MAD's context dict restored from a build manifest, and MAD's `--additional-context` parsed.
A manifest's `${NAME}` value is resolved from the node's environment, or its key dropped with a warning."""

from __future__ import annotations

import ast
import copy
import json
import re
import warnings

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SECRET_PREFIX
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# Keys of the build's context that a node restores from the manifest (MAD restores the same ones).
RESTORED_KEYS = ("docker_mounts", "docker_build_arg", "docker_gpus", "gpu_vendor", "guest_os", "docker_env_vars")
# Of those, the ones holding a name -> value mapping: restored entry by entry.
MAPPING_KEYS = ("docker_mounts", "docker_build_arg", "docker_env_vars")

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class RunContextError(UserError):
    """A context, manifest context or `--additional-context` value that cannot be used as given."""


def is_secret_name(name: str) -> bool:
    """True for the names MAD treats as secrets (`MAD_SECRETS_*`): never in argv, logs, manifests or output."""
    return str(name).startswith(SECRET_PREFIX)


def placeholder_names(value) -> list:
    """The environment variable names that `value` references as `${VAR}` or `$VAR` (empty for non-strings)."""
    if not isinstance(value, str):
        return []
    return [braced or bare for braced, bare in _PLACEHOLDER.findall(value)]


def is_placeholder_only(value) -> bool:
    """True for a string made only of `${VAR}`/`$VAR` references (`${MAD_SECRETS_HFTOKEN}`): no data of its own."""
    return isinstance(value, str) and bool(placeholder_names(value)) and not _PLACEHOLDER.sub("", value)


def secret_literals(context, path="") -> list:
    """The paths (keys only, never values) where `context` gives a `MAD_SECRETS_*` key a literal value instead of a
    `${NAME}` reference: a secret in a context would sit in argv, the job's vars file and the dry-run output."""
    found = []
    if isinstance(context, dict):
        for key, value in context.items():
            where = f"{path}.{key}" if path else str(key)
            if is_secret_name(key) and not is_placeholder_only(value):
                found.append(where)
            else:
                found += secret_literals(value, where)
    elif isinstance(context, list):
        for index, item in enumerate(context):
            found += secret_literals(item, f"{path}[{index}]")
    return found


def expand_placeholders(value, environ):
    """`value` with its `${VAR}` / `$VAR` references resolved from `environ`; None when one is missing there (a
    half-expanded placeholder must never reach a container). Anything without references is returned unchanged."""
    names = placeholder_names(value)
    if not names:
        return value
    if any(name not in environ for name in names):
        return None
    return _PLACEHOLDER.sub(lambda match: environ[match.group(1) or match.group(2)], value)


def _warn_default(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _resolve_manifest_value(where: str, value, environ, warn, defer_secrets: bool):
    """A manifest value with its placeholders resolved, or None (with a warning) when they cannot be."""
    if defer_secrets and any(is_secret_name(name) for name in placeholder_names(value)):
        return value
    expanded = expand_placeholders(value, environ)
    if expanded is None:
        missing = [name for name in placeholder_names(value) if name not in environ]
        warn(
            f"{where} in the build manifest refers to ${{{missing[0]}}}, which is not set in this node's environment: "
            f"left unset (export {', '.join(missing)} in the job's environment to pass it)"
        )
    return expanded


def restore_context(manifest_context, runtime_context, environ, warn=None, defer_secrets=False) -> dict:
    """The run context of a node: the runtime context with the manifest's `RESTORED_KEYS` restored under it.

    What the node detected wins. Unresolvable placeholders drop their entry and call `warn(message)` (messages name
    keys, never values). With `defer_secrets`, `${MAD_SECRETS_*}` stay for the run module: use it whenever the result
    becomes module output or an Ansible variable."""
    warn = warn or _warn_default
    manifest_context = manifest_context or {}
    if not isinstance(manifest_context, dict):
        raise RunContextError(f"the build manifest's context must be an object, not {type(manifest_context).__name__}")
    restored = copy.deepcopy(dict(runtime_context or {}))
    for key in RESTORED_KEYS:
        if key not in manifest_context:
            continue
        stored = manifest_context[key]
        if key in MAPPING_KEYS:
            if not isinstance(stored, dict):
                raise RunContextError(
                    f"the build manifest's context.{key} must be an object of name: value, not {type(stored).__name__}"
                )
            runtime_entries = restored.get(key) or {}
            merged = {}
            for name, value in stored.items():
                if name in runtime_entries:
                    continue
                value = _resolve_manifest_value(f"context.{key}.{name}", value, environ, warn, defer_secrets)
                if value is not None:
                    merged[name] = value
            merged.update(runtime_entries)
            restored[key] = merged
        elif restored.get(key) in (None, ""):
            value = _resolve_manifest_value(f"context.{key}", stored, environ, warn, defer_secrets)
            if value is not None:
                restored[key] = value
    return restored


def redact_secrets(context: dict) -> dict:
    """A copy of `context` whose `MAD_SECRETS_*` entries in the mapping keys read `${NAME}`, as manifests and output
    hold them."""
    redacted = copy.deepcopy(dict(context or {}))
    for key in MAPPING_KEYS:
        entries = redacted.get(key)
        if isinstance(entries, dict):
            for name in entries:
                if is_secret_name(name):
                    entries[name] = "${" + name + "}"
    return redacted


def deep_merge(base, override) -> dict:
    """`override` merged into a copy of `base`: objects key by key, at any depth; anything else (a list too: a list
    of mounts is one value) replaced by the override's. Neither argument is modified."""
    merged = copy.deepcopy(dict(base or {}))
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_json_compatible(value, path="context"):
    """Refuse what a Python literal can hold but JSON cannot (tuples become lists)."""
    if isinstance(value, dict):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise RunContextError(f"{path}: keys must be strings, got {key!r}")
            result[key] = _check_json_compatible(item, f"{path}.{key}")
        return result
    if isinstance(value, (list, tuple)):
        return [_check_json_compatible(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise RunContextError(
        f"{path}: a {type(value).__name__} is not a JSON value (use strings, numbers, lists, objects)"
    )


def _syntax_error_position(error: SyntaxError, indent: int) -> str:
    line = error.lineno or 1
    column = (error.offset or 1) + (indent if line == 1 else 0)
    return f"line {line} column {column}"


def parse_additional_context(text, source="--additional-context") -> dict:
    """Parse MAD's `--additional-context`: a JSON object, else the Python-dict form MAD reads with
    `ast.literal_eval`; empty means none. Errors name `source` and the position of the first problem."""
    if isinstance(text, dict):
        return _check_json_compatible(text)
    if text is None or not str(text).strip():
        return {}
    text = str(text)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as json_error:
        # Python 3.8's literal_eval refuses leading blanks ("unexpected indent").
        stripped = text.lstrip(" \t")
        try:
            parsed = ast.literal_eval(stripped)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as python_error:
            looks_python = "'" in text and '"' not in text
            if looks_python and isinstance(python_error, SyntaxError):
                where = _syntax_error_position(python_error, len(text) - len(stripped))
                problem = python_error.msg
            else:
                where = f"line {json_error.lineno} column {json_error.colno}"
                problem = json_error.msg
            raise RunContextError(
                f"{source} is neither a JSON object nor MAD's Python-dict form: {problem} at {where}. "
                'Expected e.g. {"gpu_vendor": "AMD", "docker_env_vars": {"NCCL_DEBUG": "INFO"}} '
                "or {'gpu_vendor': 'AMD'}"
            ) from None
    if not isinstance(parsed, dict):
        raise RunContextError(
            f'{source} must be a JSON object ({{...}}), not a {type(parsed).__name__}: e.g. {{"gpu_vendor": "AMD"}}'
        )
    return _check_json_compatible(parsed, source)


def read_additional_context_file(path) -> dict:
    """Read MAD's `--additional-context-file` (a JSON object, or MAD's Python-dict form)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise RunContextError(f"cannot read the additional context file {path}: {error.strerror}") from None
    return parse_additional_context(text, source=str(path))
