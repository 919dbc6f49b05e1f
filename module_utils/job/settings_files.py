"""The settings a user gives outside one command: the site's file, the user's own file, the environment
(docs/settings.md); a misspelt name, or a file others own or may write, is refused. Controller side only (PyYAML)."""

import os
import shlex
import stat
from dataclasses import dataclass

import yaml

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import (
    COMPUTED,
    SETTING_DEFAULTS,
    SETTINGS,
    default_image_cache_dir,
    default_results_dir,
    setting_problems,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import closest_key
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.dir_trust import group_name, user_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

SITE_CONFIG = "/etc/slurm-multi/site.yml"
SITE_CONFIG_ENV = "SLURM_MULTI_SITE_CONFIG"
SITE_KEYS = ("node_addresses", "settings")
USER_SETTINGS_IN_HOME = os.path.join(".config", "slurm-multi", "settings.yml")
USER_SETTINGS_ENV = "SLURM_MULTI_SETTINGS"

# How the pipeline is started (push: one ansible-playbook; pull: the pull step's one per node): the CLI reads it from
# the files and the environment and passes it on; whoever starts the playbook has chosen it already, so the
# inventory never gives it (a playbook started as push must not run as pull because SLURM_MULTI_MODE says pull).
CHOSEN_BY_THE_STARTER = ("mode",)

# What one job runs, and where its value is given instead: as a default for every job it would run another image
# than the one planned, or hand every job the same credentials or secrets outside their private 0600 copies.
PER_JOB_SETTINGS = {
    "manifest_path": "--manifest or -e manifest_path=...",
    "use_image": "--use-image or -e use_image=...",
    "credentials_file": "--credentials or -e credentials_file=...",
    "secrets_file": "MAD_SECRETS_* in your environment: submit writes them to the job's private 0600 file",
}

# The setting that takes one string of `docker run` options: in `-e NAME=WORDS`, the words up to the next setting's
# are its options (`-e "additional_docker_run_options=--ulimit memlock=-1"`), split as a shell splits them.
SHELL_WORDS_SETTING = "additional_docker_run_options"

EXTRA_VARS_FORMS = (
    "KEY=VALUE (several in one -e, space-separated; VALUE read as YAML, so 42 stays a number), a JSON or YAML "
    "mapping ('{\"barrier_timeout\": 900}') or @FILE (a YAML or JSON file of setting: value)"
)


class SettingsError(UserError):
    """A settings file, -e or a settings environment variable that cannot be used as given."""


@dataclass(frozen=True)
class Settings:
    """What the site and user files and the environment give: ``values`` (setting -> value, the higher source's where
    several give one) and the site's ``node_addresses`` (node name -> address)."""

    values: dict
    node_addresses: dict


def site_config_path(environ=None) -> str:
    """$SLURM_MULTI_SITE_CONFIG, else /etc/slurm-multi/site.yml."""
    environ = os.environ if environ is None else environ
    return environ.get(SITE_CONFIG_ENV) or SITE_CONFIG


def user_settings_path(environ=None) -> str:
    """$SLURM_MULTI_SETTINGS, else ~/.config/slurm-multi/settings.yml."""
    environ = os.environ if environ is None else environ
    if environ.get(USER_SETTINGS_ENV):
        return environ[USER_SETTINGS_ENV]
    return os.path.join(environ.get("HOME") or os.path.expanduser("~"), USER_SETTINGS_IN_HOME)


def read_settings(environ=None, site_config=None) -> Settings:
    """The site file's settings, the user file's over them, the settings' environment variables over both; a
    missing file gives nothing, a bad one (`settings_layers`) is refused naming it."""
    layers, addresses = settings_layers(environ, site_config)
    values = {}
    for _, given in layers:
        values.update(given)
    return Settings(values, addresses)


def settings_layers(environ=None, site_config=None):
    """``([(source, {setting: value}), ...], node_addresses)``: the site file's, the user file's and the environment
    variables' settings, lowest first, each source named (a file's path, or the variable)."""
    environ = os.environ if environ is None else environ
    site_path = site_config or site_config_path(environ)
    _refuse_a_missing_named_file(site_path, None if site_config else SITE_CONFIG_ENV, environ)
    _refuse_a_missing_named_file(user_settings_path(environ), USER_SETTINGS_ENV, environ)
    site = _read_mapping(site_path, "node_addresses: (node: address) and settings: (setting: value)", check_owner=True)
    for key in site:
        if key not in SITE_KEYS:
            raise SettingsError(_unknown(site_path, key, SITE_KEYS, "key"))
    addresses = _mapping_of(site, "node_addresses", site_path, "node names to addresses")
    user_path = user_settings_path(environ)
    layers = [
        (site_path, _file_settings(_mapping_of(site, "settings", site_path, "setting names to values"), site_path)),
        (user_path, _file_settings(_read_mapping(user_path, "setting: value", check_owner=True), user_path)),
    ]
    for name, setting in SETTINGS.items():
        if setting.env and environ.get(setting.env):
            source = f"${setting.env}"
            layers.append((source, check_settings({name: environ[setting.env]}, source)))
    return layers, {str(node): str(address) for node, address in addresses.items()}


def _refuse_a_missing_named_file(path: str, variable, environ) -> None:
    """A settings file the environment names must exist: a misspelt path would silently leave out every setting the
    user or the site meant to give (the default paths may be missing: no settings there)."""
    if variable and environ.get(variable) and not os.path.lexists(path):
        default = SITE_CONFIG if variable == SITE_CONFIG_ENV else os.path.join("~", USER_SETTINGS_IN_HOME)
        raise SettingsError(
            f"${variable} names {path}, which does not exist: fix the path, create the file (an empty one gives no "
            f"settings), or unset {variable} to use the default ({default})"
        )


def effective_settings(extra_vars=None, environ=None):
    """Every setting as a job submitted from here would get it, before any inventory of the user's own:
    ``[(name, value, source)]`` in the table's order; source is ``default``, a file's path, ``$VARIABLE`` or
    ``-e``. A computed default is worked out (results_dir from the environment, image_cache_dir from results_dir)
    or, for the models file, named in words."""
    environ = os.environ if environ is None else environ
    layers, _ = settings_layers(environ)
    chosen = {}
    for source, given in layers + [("-e", dict(extra_vars or {}))]:
        chosen.update({name: (value, source) for name, value in given.items()})
    shown = []
    for name, setting in SETTINGS.items():
        if name in chosen:
            value, source = chosen[name]
        elif name == "results_dir":
            value, source = default_results_dir(environ), "default"
        elif name == "image_cache_dir":
            results_dir = chosen["results_dir"][0] if "results_dir" in chosen else default_results_dir(environ)
            value, source = default_image_cache_dir(str(results_dir)), "default"
        elif setting.default is COMPUTED:
            value, source = setting.computed, "default"
        else:
            value, source = SETTING_DEFAULTS[name], "default"
        shown.append((name, value, source))
    return shown


def _file_settings(values, path: str) -> dict:
    values = check_settings(values, path)
    for name, instead in PER_JOB_SETTINGS.items():
        if name in values:
            raise SettingsError(
                f"{path}: {name} belongs to one job, not to every job: give it with the job ({instead})"
            )
    return values


def check_settings(values, source: str) -> dict:
    """``values`` (a mapping of setting -> value), each name and value checked against the table of settings (its
    kind, choices and range: `setting_problems`, the job's own check)."""
    for name in values:
        if name not in SETTINGS:
            raise SettingsError(_unknown(source, name, SETTINGS, "setting"))
    problems = setting_problems(values, source)
    if problems:
        raise SettingsError("; ".join(problems))
    return dict(values)


def parse_extra_vars(texts) -> dict:
    """What ``-e`` options give, as ansible-playbook reads them, later ones winning: ``KEY=VALUE`` words, a JSON or
    YAML mapping, or ``@FILE``. Every name is a setting's."""
    extra_vars = {}
    for text in texts or ():
        text = str(text).strip()
        if text.startswith("@"):
            path = os.path.expanduser(text[1:])
            if not os.path.isfile(path):
                raise SettingsError(f"-e {text}: {path} does not exist or is not a file")
            extra_vars.update(check_settings(_read_mapping(path, "setting: value"), f"-e {text}"))
        elif text.startswith(("{", "[")):
            given = _load_yaml(text, f"-e {text}")
            if not isinstance(given, dict):
                raise SettingsError(
                    f"-e {text}: expected a mapping of setting names to values, got a {type(given).__name__}"
                )
            extra_vars.update(check_settings(given, f"-e {text}"))
        else:
            extra_vars.update(_key_values(text))
    return extra_vars


def _key_values(text: str) -> dict:
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise SettingsError(f"-e {text}: {exc}; the forms accepted: {EXTRA_VARS_FORMS}") from None
    values, options = {}, []
    for word in words or [text]:
        name, equals, value = word.partition("=")
        if options and not (equals and name in SETTINGS):
            options.append(word)  # one more word of one string of options
            continue
        if not equals or not name:
            raise SettingsError(f"-e {text}: {word!r} is no KEY=VALUE; the forms accepted: {EXTRA_VARS_FORMS}")
        if options:
            values[SHELL_WORDS_SETTING] = _options_text(options)
            options = []
        if name == SHELL_WORDS_SETTING and not value.startswith(("[", "{")):
            options = [value]  # the words up to the next setting's are its options
            continue
        # An empty value is the empty string, as ansible-playbook has it (YAML would make it null).
        values[name] = _load_yaml(value, f"-e {word}") if value else ""
    if options:
        values[SHELL_WORDS_SETTING] = _options_text(options)
    return check_settings(values, f"-e {text}")


def _options_text(words) -> str:
    """The options' one string: a word given quoted as a whole is that string, several words are quoted back so that
    the job's shell-like split gives them again."""
    return words[0] if len(words) == 1 else shlex.join(words)


def _unknown(source: str, name, known, what: str) -> str:
    suggestion = closest_key(str(name), known)
    hint = f" (did you mean {suggestion}?)" if suggestion else ""
    listed = "the settings are listed in docs/settings.md" if what == "setting" else f"it holds {', '.join(known)}"
    return f"{source}: unknown {what} {name!r}{hint}; {listed}"


def _load_yaml(text: str, source: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None


def _yaml_problem(exc) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"line {mark.line + 1} column {mark.column + 1}: {problem}" if mark else problem


def check_settings_file(path: str, status: os.stat_result) -> None:
    """Refuse the settings file ``path`` (``status``: the opened file's) unless you or root own it and only its owner
    may write it: whoever else may write it decides what every job gets."""
    if status.st_uid not in (os.geteuid(), 0):
        raise SettingsError(
            f"{path} is owned by {user_name(status.st_uid)}, not by you or root: its owner decides what every job "
            f"of yours gets (node addresses, the results dir). Fix: chown root {path} (a site file), or use a "
            "settings file of your own"
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        writers = "every user" if status.st_mode & stat.S_IWOTH else f"its group {group_name(status.st_gid)}"
        raise SettingsError(
            f"{path} is writable by {writers} (mode {stat.S_IMODE(status.st_mode):04o}): any of them could decide "
            f"what every job gets (node addresses, the results dir). Fix: chmod go-w {path}"
        )


def _read_mapping(path: str, shape: str, check_owner: bool = False) -> dict:
    """The YAML mapping in ``path`` ({} when the file does not exist or is empty); ``check_owner``: a settings file,
    checked (`check_settings_file`) on the very file read."""
    try:
        with open(path, encoding="utf-8") as handle:
            if check_owner:
                check_settings_file(path, os.fstat(handle.fileno()))
            text = handle.read()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}") from None
    data = _load_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping ({shape}), got a {type(data).__name__}")
    return data


def _mapping_of(data: dict, key: str, path: str, what: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise SettingsError(f"{path}: {key} must map {what}, got {value!r}")
    return value
