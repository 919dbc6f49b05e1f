"""The KFD topology in sysfs: which render node (`/dev/dri/renderD<N>`) belongs to which AMD GPU, matched by PCI
address, never by position (the tool and the topology may list a different number of devices)."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.records import GpuToolOutputError

KFD_TOPOLOGY_NODES = "/sys/class/kfd/kfd/topology/nodes"


def parse_kfd_node_properties(text: str, source: str = "KFD node properties") -> Dict[str, int]:
    """The `key value` lines of a KFD topology node's `properties` file, as integers."""
    properties = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not re.match(r"^-?\d+$", parts[1]):
            raise GpuToolOutputError(source, f"line {number} is not '<key> <integer>': {line.strip()!r}")
        properties[parts[0]] = int(parts[1])
    return properties


def read_kfd_gpu_nodes(nodes_dir: str = KFD_TOPOLOGY_NODES) -> List[Dict[str, Any]]:
    """The GPU nodes (CPU nodes have no SIMDs) of the KFD topology: `node`, `pci_bus` and `render_node` of each;
    OSError when it cannot be read, GpuToolOutputError when a properties file is malformed."""
    nodes = []
    for node in sorted(int(name) for name in os.listdir(nodes_dir) if name.isdigit()):
        path = os.path.join(nodes_dir, str(node), "properties")
        with open(path, encoding="utf-8", errors="replace") as handle:
            properties = parse_kfd_node_properties(handle.read(), path)
        if properties.get("simd_count", 0) <= 0:
            continue
        # location_id is the PCI bus/device/function packed as the kernel's PCI_DEVID: bus << 8 | devfn.
        location = properties.get("location_id", 0)
        bus, devfn = (location >> 8) & 0xFF, location & 0xFF
        pci_bus = f"{properties.get('domain', 0):04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 0x7}"
        render = properties.get("drm_render_minor")
        nodes.append({"node": node, "pci_bus": pci_bus, "render_node": render if render and render > 0 else None})
    return nodes


def attach_render_nodes(gpus: Sequence[Dict[str, Any]], kfd_nodes: Sequence[Dict[str, Any]]):
    """(GPU records with `render_node` set from the KFD topology, warnings): a GPU with no address, no KFD node or
    several at its address keeps None and gets a warning."""
    by_address: Dict[str, List[Dict[str, Any]]] = {}
    for node in kfd_nodes:
        by_address.setdefault(node["pci_bus"], []).append(node)
    result, warnings = [], []
    for gpu in gpus:
        gpu = dict(gpu)
        matches = by_address.get(gpu["pci_bus"] or "", [])
        if len(matches) == 1 and matches[0]["render_node"] is not None:
            gpu["render_node"] = matches[0]["render_node"]
        elif not gpu["pci_bus"]:
            warnings.append(f"GPU {gpu['index']} has no PCI address, so its render node is unknown")
        elif not matches:
            warnings.append(f"GPU {gpu['index']} ({gpu['pci_bus']}) is not in the KFD topology: render node unknown")
        else:
            nodes = ", ".join(str(node["node"]) for node in matches)
            warnings.append(
                f"GPU {gpu['index']} ({gpu['pci_bus']}) matches KFD nodes {nodes} without one render node: "
                "render node unknown"
            )
        result.append(gpu)
    return result, warnings
