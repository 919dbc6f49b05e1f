"""The AMD tools' output: `amd-smi` (list and static views, JSON) and `rocm-smi` (JSON), as GPU records."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.records import (
    GpuToolOutputError,
    check_unique_indices,
    extract_json_document,
    field_value,
    gpu_index,
    gpu_record,
    pci_address,
)

_ROCM_SMI_CARD = re.compile(r"^card(\d+)$")


def _amd_smi_entries(document: Any, tool: str) -> List[Dict[str, Any]]:
    """The per-GPU entries of amd-smi JSON: a bare array (before 26.x) or `{"gpu_data": [...]}` (26.x)."""
    if isinstance(document, dict) and "gpu_data" in document:
        document = document["gpu_data"]
    if not isinstance(document, list):
        raise GpuToolOutputError(tool, f"expected a JSON array of GPUs, got a JSON {type(document).__name__}")
    entries = []
    for position, entry in enumerate(document):
        if not isinstance(entry, dict):
            raise GpuToolOutputError(tool, f"entry {position} is a {type(entry).__name__}, not an object")
        # Newer amd-smi also lists NICs and CPUs in the same array; they have no "gpu" key.
        if "gpu" in entry:
            entries.append(entry)
    if document and not entries:
        keys = sorted(document[0].keys()) if isinstance(document[0], dict) else []
        raise GpuToolOutputError(tool, f"no entry has a 'gpu' index (keys seen: {', '.join(keys)})")
    return entries


def parse_amd_smi_list_json(text: str) -> List[Dict[str, Any]]:
    """GPU records (index, uuid, pci_bus) from `amd-smi list --json` (a host's `vfs`, its guests' devices, ignored)."""
    tool = "amd-smi list --json"
    gpus = []
    for entry in _amd_smi_entries(extract_json_document(text, tool), tool):
        index = gpu_index(entry["gpu"], tool, "entry 'gpu'")
        gpus.append(gpu_record(index, uuid=field_value(entry.get("uuid")), pci_bus=pci_address(entry.get("bdf"), tool)))
    check_unique_indices(gpus, tool)
    return gpus


def parse_amd_smi_static_json(text: str) -> Dict[int, Dict[str, Optional[str]]]:
    """Per GPU index: `name` (market name), `arch` (gfx target) and `pci_bus`, from `amd-smi static --asic --json`."""
    tool = "amd-smi static --json"
    details: Dict[int, Dict[str, Optional[str]]] = {}
    for entry in _amd_smi_entries(extract_json_document(text, tool), tool):
        index = gpu_index(entry["gpu"], tool, "entry 'gpu'")
        if index in details:
            raise GpuToolOutputError(tool, f"GPU index {index} is listed twice")
        asic = entry.get("asic") if isinstance(entry.get("asic"), dict) else {}
        bus = entry.get("bus") if isinstance(entry.get("bus"), dict) else {}
        details[index] = {
            "name": field_value(asic.get("market_name")),
            "arch": field_value(asic.get("target_graphics_version")),
            "pci_bus": pci_address(bus.get("bdf"), tool),
        }
    return details


def parse_rocm_smi_json(text: str) -> List[Dict[str, Any]]:
    """GPU records from `rocm-smi --showproductname --showbus --showuniqueid --json`'s `cardN` keys (N the index)."""
    tool = "rocm-smi --json"
    document = extract_json_document(text, tool)
    if not isinstance(document, dict):
        raise GpuToolOutputError(tool, f"expected a JSON object of cards, got a JSON {type(document).__name__}")
    gpus = []
    for key, card in document.items():
        match = _ROCM_SMI_CARD.match(key)
        if not match:
            continue
        if not isinstance(card, dict):
            raise GpuToolOutputError(tool, f"{key} is a {type(card).__name__}, not an object")
        names = (field_value(card.get(key)) for key in ("Device Name", "Card Series", "Card series"))
        name = next((name for name in names if name), None)
        gpus.append(
            gpu_record(
                int(match.group(1)),
                name=name,
                uuid=field_value(card.get("Unique ID")),
                pci_bus=pci_address(card.get("PCI Bus"), tool),
                arch=field_value(card.get("GFX Version")),
            )
        )
    gpus.sort(key=lambda gpu: gpu["index"])
    check_unique_indices(gpus, tool)
    return gpus
