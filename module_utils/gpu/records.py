"""One GPU as every tool parser returns it, and how the tools' raw fields (banners, cut-off output, `[N/A]`...)
become its values."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# What the tools print where a value is unknown; the record holds None instead.
_MISSING_VALUES = {"", "n/a", "[n/a]", "unknown", "[unknown error]", "not supported", "[not supported]"}

_PCI_ADDRESS = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class GpuToolOutputError(UserError):
    """A GPU tool's output could not be read; the message names the tool and what was wrong."""

    def __init__(self, tool: str, problem: str):
        self.tool = tool
        self.problem = problem
        super().__init__(f"{tool}: {problem}")


def gpu_record(
    index: int,
    name: Optional[str] = None,
    uuid: Optional[str] = None,
    pci_bus: Optional[str] = None,
    arch: Optional[str] = None,
) -> Dict[str, Any]:
    """One GPU as every parser returns it, the same keys for every vendor; `index` is SLURM's GPU index."""
    return {
        "index": index,
        "name": name,
        "uuid": uuid,
        "pci_bus": pci_bus,
        "arch": arch,
        "render_node": None,
        "mig_devices": [],
    }


def output_excerpt(text: str) -> str:
    """A short one-line view of tool output for error messages."""
    flat = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    if not flat:
        return "(empty output)"
    return flat if len(flat) <= 200 else flat[:197] + "..."


def field_value(raw: Any) -> Optional[str]:
    """A tool's field as text, or None for the tools' many spellings of 'unknown'."""
    if raw is None or isinstance(raw, (dict, list)):
        return None
    text = str(raw).strip()
    return None if text.lower() in _MISSING_VALUES else text


def pci_address(raw: Any, tool: str) -> Optional[str]:
    """A PCI address normalized to sysfs form (`0000:2f:00.0`), whatever domain width and case the tool prints."""
    text = field_value(raw)
    if text is None:
        return None
    match = _PCI_ADDRESS.match(text)
    if not match:
        raise GpuToolOutputError(tool, f"{text!r} is not a PCI address (expected e.g. 0000:2f:00.0)")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def gpu_index(raw: Any, tool: str, where: str) -> int:
    """A device index that must be a non-negative integer (JSON int or digits)."""
    if isinstance(raw, bool):
        raise GpuToolOutputError(tool, f"{where}: GPU index {raw!r} is not a number")
    if isinstance(raw, int) and raw >= 0:
        return raw
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw.strip())
    raise GpuToolOutputError(tool, f"{where}: GPU index {raw!r} is not a non-negative integer")


def check_unique_indices(gpus: Sequence[Dict[str, Any]], tool: str) -> None:
    """Refuse a listing that names one GPU index twice: SLURM's indices would then be ambiguous."""
    seen = set()
    for gpu in gpus:
        if gpu["index"] in seen:
            raise GpuToolOutputError(tool, f"GPU index {gpu['index']} is listed twice")
        seen.add(gpu["index"])


def extract_json_document(text: str, tool: str) -> Any:
    """The first complete JSON document in a tool's output (one starting with `[` or `{` at the start of a line),
    ignoring banners before it and anything after it."""
    decoder = json.JSONDecoder()
    starts = [match.start() for match in re.finditer(r"^[\[{]", text, re.MULTILINE)]
    if not starts:
        raise GpuToolOutputError(tool, f"no JSON in the output: {output_excerpt(text)}")
    furthest = None
    for start in starts:
        try:
            document, _end = decoder.raw_decode(text, start)
            return document
        except json.JSONDecodeError as error:
            if furthest is None or error.pos > furthest.pos:
                furthest = error
    raise GpuToolOutputError(
        tool,
        f"the JSON output is incomplete or malformed (truncated?): {furthest.msg} "
        f"at line {furthest.lineno} column {furthest.colno}",
    )
