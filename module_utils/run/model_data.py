"""A model's data as MAD's cards name it: the card's `data` names entries of the zoo's data.json (the context's `data`
over them), each with providers; this tool implements madengine's `local` provider (a path on storage the nodes
see, mounted into the container) and refuses the others by name before anything is queued (docs/using.md, Data)."""

import json
import os
from typing import Any, Dict, List, Mapping

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

DATA_FILE = "data.json"
# madengine's order of trying an entry's providers (core/dataprovider.py): the first that works is used.
PROVIDER_ORDER = ("custom", "local", "minio", "nas", "aws")
# What the providers this tool does not implement would do, for their refusal.
NOT_IMPLEMENTED = {
    "custom": "runs the entry's download script on the node",
    "minio": "downloads from a MinIO bucket",
    "nas": "mounts a NAS over sshfs or copies it with rsync",
    "aws": "downloads from an S3 bucket",
}
# madengine's container path of the i-th data without a `home`: /data_dlm_<i>.
DEFAULT_DATA_HOME = "/data_dlm"


class ModelDataError(UserError):
    """A card's data that cannot be given to its container as named."""


def data_config(zoo_dir: str, context: Mapping[str, Any]) -> Dict[str, Any]:
    """The data entries a job's cards may name: ``<zoo_dir>/data.json`` (none when missing), the context's ``data``
    over it entry by entry, as madengine reads them."""
    path = os.path.join(zoo_dir, DATA_FILE)
    entries = {}  # type: Dict[str, Any]
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as handle:
                entries = json.load(handle)
        except (OSError, ValueError) as error:
            raise ModelDataError(f"cannot read the data config {path}: {error}") from None
        if not isinstance(entries, dict):
            raise ModelDataError(f"the data config {path} must be a JSON object of data names")
    given = (context or {}).get("data") or {}
    if not isinstance(given, Mapping):
        raise ModelDataError(f"the context's data must be an object of data names, like {DATA_FILE}'s, not {given!r}")
    entries.update(given)
    return entries


def _local_provider(name: str, entry: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping):
        raise ModelDataError(f'data {name!r} in {where} must be an object of providers such as {{"local": ...}}')
    providers = [provider for provider in PROVIDER_ORDER if provider in entry]
    first = providers[0] if providers else None
    if first != "local":
        given = ", ".join(sorted(map(str, entry))) or "none"
        named = first or given
        what = NOT_IMPLEMENTED.get(str(first), "is not one of madengine's providers")
        raise ModelDataError(
            f"data {name!r} in {where} would come from its {named!r} provider, which {what}: slurm-multi implements "
            f"the local provider alone (its providers: {given}). Put the data on storage every node sees and give "
            f'the entry a "local": {{"path": "/shared/datasets/{name}"}} provider (first in madengine\'s order, '
            "before any other but custom), or run this model with madengine"
        )
    local = entry["local"]
    if not isinstance(local, Mapping) or not isinstance(local.get("path"), str) or not local["path"]:
        raise ModelDataError(f'data {name!r} in {where}: its local provider needs a "path" (a directory)')
    if "mirrorlocal" in local:
        raise ModelDataError(f"data {name!r} in {where}: the local provider takes no mirrorlocal (madengine's rule)")
    if not os.path.isabs(local["path"]):
        raise ModelDataError(f"data {name!r} in {where}: the local path {local['path']!r} must be absolute")
    return local


def card_data(card: Mapping[str, Any], entries: Mapping[str, Any], where: str = DATA_FILE) -> Dict[str, Any]:
    """What the card's `data` gives its container, as madengine's local provider gives it: ``mounts``, one
    ``host:container[:ro]`` bind per data (read-only unless its ``readwrite`` is "true"), and ``env``,
    ``MAD_DATAHOME`` (the container paths, comma-separated) and ``MAD_DATANAME`` (the card's `data`). Each data
    is mounted at its ``home``, else ``/data_dlm_<i>`` for the i-th name. Empty without data."""
    names_text = (card or {}).get("data") or ""
    if not isinstance(names_text, str):
        raise ModelDataError(f"model {card.get('name', '?')}: data must be a string of data names, not {names_text!r}")
    names = [name.strip() for name in names_text.split(",") if name.strip()]
    mounts = []  # type: List[str]
    homes = []  # type: List[str]
    for index, name in enumerate(names):
        if name not in entries:
            known = ", ".join(sorted(entries)) or "none"
            raise ModelDataError(
                f"model {card.get('name', '?')} names data {name!r}, which {where} does not define (its data: "
                f'{known}): add an entry {{"{name}": {{"local": {{"path": ...}}}}}} to {where} or the context\'s data'
            )
        local = _local_provider(name, entries[name], where)
        home = str(local.get("home") or f"{DEFAULT_DATA_HOME}_{index}")
        if ":" in local["path"] or ":" in home:
            raise ModelDataError(f"data {name!r}: a path holding ':' cannot be bound into a container")
        read_only = str(local.get("readwrite", "")).lower() != "true"
        mounts.append(f"{local['path']}:{home}" + (":ro" if read_only else ""))
        homes.append(home)
    if not names:
        return {"mounts": [], "env": {}}
    return {"mounts": mounts, "env": {"MAD_DATAHOME": ",".join(homes), "MAD_DATANAME": names_text}}


def missing_data_paths(mounts: List[str]) -> List[str]:
    """The host paths of ``mounts`` (``host:container[:mode]``) that do not exist on this node: a bind of a missing
    path would give the model an empty directory (Docker makes one), its data silently absent."""
    return [mount.split(":", 1)[0] for mount in mounts if not os.path.exists(mount.split(":", 1)[0])]
