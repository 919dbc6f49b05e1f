"""MAD's model zoo cards (models.json, `--tags`) and build manifest (build_manifest.json), as MAD reads them."""

from __future__ import annotations

import json
import os

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import redact_secrets
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import (
    manifest_deployment_config,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.model_card_fields import (
    CardFieldError,
    check_card_fields,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# What MAD's build records of its context (plus guest_os, which the nodes restore too).
MANIFEST_CONTEXT_KEYS = (
    "docker_env_vars",
    "docker_mounts",
    "docker_build_arg",
    "gpu_vendor",
    "docker_gpus",
    "guest_os",
    "tools",
    "pre_scripts",
    "post_scripts",
    "encapsulate_script",
)
NESTED_MODELS_DIR = "scripts"


class ManifestError(UserError):
    """A models.json, build_manifest.json or tag selection that cannot be used, said in terms of the file."""


def _read_json(path, what: str):
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ManifestError(f"{what} {path} does not exist") from None
    except OSError as error:
        raise ManifestError(f"cannot read {what} {path}: {error.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ManifestError(
            f"{what} {path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None


def _check_card(card, index: int, path) -> None:
    if not isinstance(card, dict):
        raise ManifestError(f"{path}: model card #{index} must be an object, not {type(card).__name__}")
    name = card.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ManifestError(f"{path}: model card #{index} has no 'name' (a non-empty string)")
    dockerfile = card.get("dockerfile")
    if not isinstance(dockerfile, str) or not dockerfile.strip():
        raise ManifestError(f"{path}: model {name!r} has no 'dockerfile' (a path prefix such as \"docker/{name}\")")
    tags = card.get("tags", [])
    if not isinstance(tags, (list, str)):
        raise ManifestError(f"{path}: model {name!r}: 'tags' must be a list of strings")


def checked_card(card: dict, source) -> dict:
    """`card` once its run fields (args, timeout, n_gpus, ...) have the types MAD gives them; ManifestError else."""
    try:
        check_card_fields(card)
    except CardFieldError as error:
        raise ManifestError(f"{source}: {error}") from None
    return card


def _read_cards(path) -> list:
    cards = _read_json(path, "models file")
    if not isinstance(cards, list):
        raise ManifestError(f"{path} must hold a JSON list of model cards, not a {type(cards).__name__}")
    for index, card in enumerate(cards):
        _check_card(card, index, path)
    return cards


def load_model_cards(models_file) -> list:
    """The model cards of a MAD zoo: `models_file` plus `scripts/<dir>/models.json` files, a nested card named
    `<dir>/<name>` with its paths made relative to the zoo root, as MAD does (but `scripts/<dir>/get_models_json.py`
    generators are not run: they execute code). Duplicate names are refused: `--tags <name>` must mean one card."""
    models_file = os.path.abspath(str(models_file))
    cards = [dict(card) for card in _read_cards(models_file)]
    nested_root = os.path.join(os.path.dirname(models_file), NESTED_MODELS_DIR)
    if os.path.isdir(nested_root):
        for dirname in sorted(os.listdir(nested_root)):
            nested_file = os.path.join(nested_root, dirname, "models.json")
            if not os.path.isfile(nested_file):
                continue
            for card in _read_cards(nested_file):
                card = dict(card)
                card["name"] = f"{dirname}/{card['name']}"
                card["dockerfile"] = os.path.normpath(os.path.join(NESTED_MODELS_DIR, dirname, card["dockerfile"]))
                if card.get("scripts"):
                    card["scripts"] = os.path.normpath(os.path.join(NESTED_MODELS_DIR, dirname, card["scripts"]))
                cards.append(card)
    seen = set()
    for card in cards:
        if card["name"] in seen:
            raise ManifestError(f"{models_file}: two model cards are named {card['name']!r}; names must be unique")
        seen.add(card["name"])
    return cards


def card_tags(card: dict) -> list:
    """A card's tags as a list (MAD also accepts a comma-separated string)."""
    tags = card.get("tags") or []
    if isinstance(tags, str):
        return [tag.strip() for tag in tags.split(",") if tag.strip()]
    return [str(tag) for tag in tags]


def _extra_args(options: list) -> str:
    """MAD's `name:key=value:flag` tag suffix as script arguments: ` --key value --flag`."""
    return "".join(" --" + option.strip().replace("=", " ") for option in options)


def _matches(card: dict, selector: str) -> bool:
    if selector == "all" or card["name"] == selector or selector in card_tags(card):
        return True
    scope, slash, tag = selector.partition("/")
    if slash and scope and tag and "/" not in tag and card["name"].startswith(scope + "/"):
        return tag == "all" or tag in card_tags(card) or card["name"] == selector
    return False


def select_model_cards(cards: list, tags) -> list:
    """The cards `--tags` selects, as MAD selects them (`all`, a name, a tag, `scope/tag`; `name:key=value` appends
    ` --key value` to the card's `args`), in selection order, each once. A tag selecting nothing, or one card
    selected twice with different args (one image name for two runs), is an error."""
    if isinstance(tags, str):
        tags = [tags]
    if not tags:
        raise ManifestError("no tags given: name the models to build, e.g. tags: [dummy] (or 'all')")
    selected = {}
    for tag in tags:
        parts = [part.strip() for part in str(tag).split(":") if part.strip()]
        if not parts:
            raise ManifestError(f"empty tag {tag!r}")
        selector, extra = parts[0], _extra_args(parts[1:])
        matched = [card for card in cards if _matches(card, selector)]
        if not matched:
            names = ", ".join(sorted(card["name"] for card in cards)) or "(none)"
            known_tags = ", ".join(sorted({t for card in cards for t in card_tags(card)})) or "(none)"
            raise ManifestError(f"tag {selector!r} matches no model. Model names: {names}. Tags: {known_tags}")
        for card in matched:
            # Only the selected cards: a zoo's other cards are not this job's business.
            chosen = dict(checked_card(card, "models file"))
            chosen["args"] = str(card.get("args") or "") + extra
            previous = selected.get(card["name"])
            if previous is not None and previous["args"] != chosen["args"]:
                raise ManifestError(
                    f"model {card['name']!r} is selected twice with different arguments "
                    f"({previous['args']!r} and {chosen['args']!r}); select it once"
                )
            selected.setdefault(card["name"], chosen)
    return list(selected.values())


def manifest_context(run_context: dict) -> dict:
    """The part of a run context a manifest records (MAD's keys), with `MAD_SECRETS_*` values as `${NAME}`."""
    recorded = {key: run_context[key] for key in MANIFEST_CONTEXT_KEYS if key in run_context}
    for key in ("docker_env_vars", "docker_mounts", "docker_build_arg"):
        recorded.setdefault(key, {})
    return redact_secrets(recorded)


def new_manifest(built_images: dict, built_models: dict, run_context: dict, deployment_config=None) -> dict:
    """A build manifest in MAD's shape; ``deployment_config`` is the job's config (`manifest_deployment_config`)."""
    return {
        "built_images": built_images,
        "built_models": built_models,
        "context": manifest_context(run_context),
        "deployment_config": manifest_deployment_config(deployment_config or {}),
    }


# What a perf row says of the image that produced it (MAD's columns), from its built_images entry.
PROVENANCE_KEYS = ("docker_image", "base_docker", "docker_sha", "build_duration", "git_commit")


def image_provenance(entry) -> dict:
    """A built_images entry's provenance: each of PROVENANCE_KEYS as text ("" where the entry has none)."""
    entry = entry if isinstance(entry, dict) else {}
    return {key: "" if entry.get(key) is None else str(entry.get(key)) for key in PROVENANCE_KEYS}


def _require_object(value, where: str, source) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"build manifest {source}: {where} must be an object, not {type(value).__name__}")
    return value


def validate_manifest(manifest, source="build_manifest.json") -> dict:
    """Check the parts of a manifest the pipeline relies on; returns it. Errors name the key and the file."""
    _require_object(manifest, "the top level", source)
    for key in ("built_images", "built_models"):
        if key not in manifest:
            raise ManifestError(f"build manifest {source} has no {key!r} (is it a MAD build_manifest.json?)")
    images = _require_object(manifest["built_images"], "'built_images'", source)
    models = _require_object(manifest["built_models"], "'built_models'", source)
    for name, entry in images.items():
        _require_object(entry, f"built_images[{name!r}]", source)
        if not isinstance(entry.get("docker_image"), str) or not entry["docker_image"]:
            raise ManifestError(f"build manifest {source}: built_images[{name!r}] has no 'docker_image' string")
    for name, card in models.items():
        _require_object(card, f"built_models[{name!r}]", source)
        if not isinstance(card.get("name"), str) or not card["name"]:
            raise ManifestError(f"build manifest {source}: built_models[{name!r}] has no model 'name'")
        checked_card(card, f"build manifest {source}")
    for key in ("context", "deployment_config"):
        if manifest.get(key) is not None:
            _require_object(manifest[key], repr(key), source)
    return manifest


def load_manifest(path) -> dict:
    """Read and validate a build_manifest.json (MAD's or ours)."""
    return validate_manifest(_read_json(path, "build manifest"), path)


def write_manifest(path, manifest: dict) -> None:
    """Write a manifest atomically: readers see the old file or the new one, never half of one."""
    validate_manifest(manifest, path)
    directory = os.path.dirname(os.path.abspath(str(path)))
    os.makedirs(directory, exist_ok=True)
    safe_files.write_file_atomically(str(path), (json.dumps(manifest, indent=2) + "\n").encode("utf-8"), 0o644)


# A sweep's build goes on past an image that fails to build; the failures are kept beside the manifest (which names
# only built images) for the sweep to record those models as not run.
BUILD_FAILURES_FILE = "build_failures.json"


def build_failures_path(manifest_path) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(str(manifest_path))), BUILD_FAILURES_FILE)


def write_build_failures(manifest_path, failures: list) -> None:
    """Write the images that failed to build: ``[{"model", "dockerfile", "image_name", "error"}]``."""
    body = (json.dumps(failures, indent=2) + "\n").encode("utf-8")
    safe_files.write_file_atomically(build_failures_path(manifest_path), body, 0o644)


def read_build_failures(manifest_path) -> list:
    """The images that failed to build beside the manifest; [] when none did (no file)."""
    path = build_failures_path(manifest_path)
    if not os.path.exists(path):
        return []
    failures = _read_json(path, "list of failed builds")
    if not isinstance(failures, list) or not all(isinstance(item, dict) and "error" in item for item in failures):
        raise ManifestError(f"{path} is not a list of failed builds; move it aside and run again")
    return failures
