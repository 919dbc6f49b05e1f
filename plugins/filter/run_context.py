"""Filter: the run context of a node, as the preparation stage restores it (logic in module_utils/job/context.py)."""

import os
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    load_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import deep_merge, restore_context
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import deployment_env_vars
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run import launchers, model_data


def _plain(value):
    """``value`` as plain dicts and lists. Ansible (2.19) hands a filter lazy containers, whose deep copy (the
    context merge makes one) copies their templar with every variable of the host, at a cost per host."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def restore_run_context(default_context, manifest_context, additional_context, detected):
    """Defaults < manifest context < the user's additional context < what the node detected itself; the container's
    `docker_env_vars` with the config's `env_vars` and `slurm.network_interface` under them (`deployment_env_vars`).

    MAD_SECRETS_* placeholders stay `${NAME}`: the run module fills them from the job's secrets file on the node,
    so no secret value ever becomes an Ansible variable.
    """
    for name, value in (("default_context", default_context), ("additional_context", additional_context)):
        if value is not None and not isinstance(value, dict):
            raise AnsibleFilterError(
                f'{name} must be a JSON object such as {{"docker_env_vars": {{"NAME": "value"}}}}, '
                f"not {type(value).__name__} {str(value)[:80]!r}"
            )
    runtime = deep_merge(_plain(additional_context or {}), _plain(detected or {}))
    restored = restore_context(_plain(manifest_context or {}), runtime, os.environ, defer_secrets=True)
    context = deep_merge(_plain(default_context or {}), restored)
    context["docker_env_vars"] = deployment_env_vars(context)
    return context


def build_manifest(path):
    """A build_manifest.json as MAD writes it, validated; a clear error naming the file when it is not."""
    try:
        return load_manifest(path)
    except ManifestError as exc:
        raise AnsibleFilterError(str(exc)) from None


def manifest_model(path):
    """The model card a manifest built first, for the job's record; {} with a warning when the manifest cannot be
    read. Collecting must still write the record of a run that failed on that very manifest (the nodes' statuses
    name the error); the record then takes the model from the attempt's own manifest, when there is one."""
    try:
        return next(iter(load_manifest(path)["built_models"].values()), {})
    except ManifestError as exc:
        Display().warning(f"{exc}; the job's record names the model its attempt recorded, if any")
        return {}


def model_distributed(card, additional_context, nnodes):
    """The model's launcher and `distributed` settings (the card's section, the job's config over it), checked
    against the job's node count, for the run module (module_utils/run/launchers.py)."""
    try:
        return launchers.model_distributed(card or {}, additional_context or {}, int(nnodes)).as_dict()
    except launchers.LauncherError as exc:
        raise AnsibleFilterError(f"model {(card or {}).get('name', '?')}: {exc}") from None


def card_data(card, models_file, run_context):
    """The card's data (its ``data``: names of the zoo's data.json beside ``models_file``, the run context's ``data``
    over them) as the container gets it: ``mounts`` and ``env`` (module_utils/run/model_data.py)."""
    try:
        entries = model_data.data_config(os.path.dirname(str(models_file)), _plain(run_context or {}))
        return model_data.card_data(
            _plain(card or {}), entries, os.path.join(os.path.dirname(str(models_file)), "data.json")
        )
    except model_data.ModelDataError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {
            "model_distributed": model_distributed,
            "card_data": card_data,
            "restore_run_context": restore_run_context,
            "build_manifest": build_manifest,
            "manifest_model": manifest_model,
        }
