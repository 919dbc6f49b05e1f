"""The NVIDIA tool's output: `nvidia-smi --query-gpu ... --format=csv` and `nvidia-smi -L`, as GPU records."""

from __future__ import annotations

import csv
import re
from typing import Any, Dict, List, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.records import (
    GpuToolOutputError,
    check_unique_indices,
    field_value,
    gpu_index,
    gpu_record,
    output_excerpt,
    pci_address,
)

_NVIDIA_LIST_GPU = re.compile(r"^GPU (\d+): (.+) \(UUID: ([^)\s]+)\)\s*$")
_NVIDIA_LIST_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: ([^)\s]+)\)\s*$")
_CSV_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")


def parse_nvidia_smi_csv(text: str) -> List[Dict[str, Optional[str]]]:
    """Rows of `nvidia-smi --query-gpu=... --format=csv` as dicts keyed by field name (units dropped, `[N/A]` None);
    a row of another length than the header (cut-off output), or no header, is an error."""
    tool = "nvidia-smi --query-gpu"
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise GpuToolOutputError(tool, "empty output (expected a CSV header line)")
    rows = list(csv.reader(lines, skipinitialspace=True))
    header = [_CSV_HEADER_UNIT.sub("", field.strip()) for field in rows[0]]
    if not all(re.match(r"^[A-Za-z_][A-Za-z0-9_.]*$", field) for field in header):
        raise GpuToolOutputError(tool, f"the first line is not a CSV header of field names: {output_excerpt(lines[0])}")
    records = []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise GpuToolOutputError(
                tool, f"line {number} has {len(row)} fields but the header has {len(header)} (truncated output?)"
            )
        records.append({field: field_value(cell) for field, cell in zip(header, row)})
    return records


def nvidia_gpus_from_rows(rows: Sequence[Dict[str, Optional[str]]]) -> List[Dict[str, Any]]:
    """GPU records from parsed `--query-gpu` rows (which must include `index`)."""
    tool = "nvidia-smi --query-gpu"
    gpus = []
    for row in rows:
        if "index" not in row:
            raise GpuToolOutputError(tool, f"the query has no 'index' field (fields: {', '.join(row)})")
        gpus.append(
            gpu_record(
                gpu_index(row["index"], tool, "field 'index'"),
                name=row.get("name"),
                uuid=row.get("uuid"),
                pci_bus=pci_address(row.get("pci.bus_id"), tool),
            )
        )
    check_unique_indices(gpus, tool)
    return gpus


def parse_nvidia_smi_list(text: str) -> List[Dict[str, Any]]:
    """GPU records (index, name, uuid, MIG instances) from `nvidia-smi -L`, its notices ignored."""
    tool = "nvidia-smi -L"
    gpus: List[Dict[str, Any]] = []
    for line in text.splitlines():
        gpu = _NVIDIA_LIST_GPU.match(line)
        if gpu:
            gpus.append(gpu_record(int(gpu.group(1)), name=gpu.group(2).strip(), uuid=gpu.group(3)))
            continue
        mig = _NVIDIA_LIST_MIG.match(line)
        if mig:
            if not gpus:
                raise GpuToolOutputError(tool, f"MIG device listed before any GPU: {line.strip()}")
            gpus[-1]["mig_devices"].append({"index": int(mig.group(2)), "profile": mig.group(1), "uuid": mig.group(3)})
    if not gpus:
        raise GpuToolOutputError(tool, f"no 'GPU <n>: <name> (UUID: ...)' line in the output: {output_excerpt(text)}")
    check_unique_indices(gpus, tool)
    return gpus
