"""The MAD model-card fields a run honours, checked before anything is built or run, and what they mean on a node.
A field of the wrong type is refused naming the model, the field, the value and the form MAD gives it."""

from __future__ import annotations

import shlex
from typing import Any, List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

ALL_GPUS = -1


class CardFieldError(UserError):
    """A model-card field of the wrong type or value, said with the model, the field and the form expected."""


def _refuse(card: Mapping[str, Any], key: str, expected: str) -> CardFieldError:
    return CardFieldError(
        f"model {card.get('name', '?')!r}: {key} {card[key]!r} ({type(card[key]).__name__}) must be {expected}"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_number(value: Any) -> Optional[float]:
    if _is_number(value):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _string_list(value: Any) -> Optional[List[str]]:
    """A list of strings from a list or a comma-separated string; None when `value` is neither."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [item.strip() for item in value if item.strip()]
    return None


def check_card_fields(card: Mapping[str, Any]) -> None:
    """Refuse a card whose run fields have the wrong type or value (CardFieldError naming model and field)."""
    if card.get("args") is not None:
        if not isinstance(card["args"], str):
            raise _refuse(card, "args", "one string of arguments, shell-quoted, e.g. \"--batch 8 --name 'a b'\"")
        try:
            shlex.split(card["args"])
        except ValueError as error:
            raise CardFieldError(
                f"model {card.get('name', '?')!r}: args {card['args']!r} cannot be split into arguments: {error}"
            ) from None
    if card.get("timeout") not in (None, ""):
        seconds = _as_number(card["timeout"])
        if seconds is None or (seconds < 0 and seconds != -1):
            raise _refuse(card, "timeout", "seconds (a number; 0 or -1 for none), e.g. 3600")
    if card.get("multiple_results") is not None and not isinstance(card["multiple_results"], str):
        raise _refuse(card, "multiple_results", 'the name of the results CSV the model writes, e.g. "perf.csv"')
    if card.get("n_gpus") not in (None, ""):
        count = _as_number(card["n_gpus"])
        if count is None or count != int(count) or count < ALL_GPUS:
            raise _refuse(card, "n_gpus", "the GPUs per node: -1 (all the node's allocated GPUs) or a count, e.g. 8")
    for key in ("skip_gpu_arch", "tags"):
        if card.get(key) not in (None, "") and _string_list(card[key]) is None:
            raise _refuse(card, key, 'a list of strings, or one comma-separated string (e.g. ["gfx90a", "A100"])')


def skipped_gpu_arch(skip_gpu_arch: Any, gpus: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """The first `skip_gpu_arch` entry that matches one of `gpus` (gpu_facts records): one equal to a GPU's `arch`
    or part of its `name`, case-insensitively; None when none does."""
    for entry in _string_list(skip_gpu_arch) or []:
        wanted = entry.lower()
        for gpu in gpus:
            arch, name = str(gpu.get("arch") or "").lower(), str(gpu.get("name") or "").lower()
            if wanted == arch or (name and wanted in name):
                return entry
    return None
