"""The GPU vendor and devices of a node, from the vendors' own tools and the KFD topology.

The tools are read as they really print: `amd-smi` and `rocm-smi` put deprecation banners, permission notices and
Python warnings before their JSON and sometimes emit a second block after it; outputs get cut off; `nvidia-smi`
pads its CSV and marks missing values as `[N/A]`. Each parser takes one format and returns a list of GPU records
(plain dicts, see `gpu_record`) or raises `GpuToolOutputError` naming the tool and what was wrong.

`detect_gpus` runs the tools found on PATH, each with a timeout, and never raises for a node without GPUs, without
a driver or without the tools: it answers vendor `none` and says why in `warnings`.

AMD GPUs are usable by a container only through their render node (`/dev/dri/renderD<N>`) and `/dev/kfd`. The
render node of each GPU comes from the KFD topology in sysfs, matched by PCI address, never by position: the tool
and the topology may list a different number of devices (partitions, an iGPU, a GPU the driver failed to bring up).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
from collections import namedtuple
from typing import Any, Callable, Dict, List, Optional, Sequence

VENDOR_AMD = "AMD"
VENDOR_NVIDIA = "NVIDIA"
VENDOR_NONE = "none"

KFD_TOPOLOGY_NODES = "/sys/class/kfd/kfd/topology/nodes"
DEFAULT_TOOL_TIMEOUT = 30.0

# What the tools print where a value is unknown; the record holds None instead.
_MISSING_VALUES = {"", "n/a", "[n/a]", "unknown", "[unknown error]", "not supported", "[not supported]"}

_PCI_ADDRESS = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_ROCM_SMI_CARD = re.compile(r"^card(\d+)$")
_NVIDIA_LIST_GPU = re.compile(r"^GPU (\d+): (.+) \(UUID: ([^)\s]+)\)\s*$")
_NVIDIA_LIST_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: ([^)\s]+)\)\s*$")
_CSV_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")


class GpuToolOutputError(ValueError):
    """A GPU tool's output could not be read; the message names the tool and what was wrong."""

    def __init__(self, tool: str, problem: str):
        self.tool = tool
        self.problem = problem
        super().__init__(f"{tool}: {problem}")


def gpu_record(index: int, name: Optional[str] = None, uuid: Optional[str] = None, pci_bus: Optional[str] = None,
               arch: Optional[str] = None, render_node: Optional[int] = None,
               mig_devices: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One GPU as every parser returns it: same keys for every vendor, None where the tool does not say.

    `index` is the tool's device index (amd-smi `gpu`, rocm-smi `GPU[n]`, nvidia-smi `index`), the number SLURM's
    GPU variables use; `pci_bus` is a lower-case `dddd:bb:dd.f` address; `render_node` the N of
    `/dev/dri/renderD<N>` (AMD); `mig_devices` the MIG instances of an NVIDIA GPU in MIG mode.
    """
    return {
        "index": index,
        "name": name,
        "uuid": uuid,
        "pci_bus": pci_bus,
        "arch": arch,
        "render_node": render_node,
        "mig_devices": list(mig_devices or []),
    }


def _excerpt(text: str, limit: int = 200) -> str:
    """A short one-line view of tool output for error messages."""
    flat = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    if not flat:
        return "(empty output)"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _value(raw: Any) -> Optional[str]:
    """A tool's field as text, or None for the tools' many spellings of 'unknown'."""
    if raw is None or isinstance(raw, (dict, list)):
        return None
    text = str(raw).strip()
    return None if text.lower() in _MISSING_VALUES else text


def _pci_bus(raw: Any, tool: str) -> Optional[str]:
    """A PCI address normalized to sysfs form (`0000:2f:00.0`), whatever domain width and case the tool prints."""
    text = _value(raw)
    if text is None:
        return None
    match = _PCI_ADDRESS.match(text)
    if not match:
        raise GpuToolOutputError(tool, f"{text!r} is not a PCI address (expected e.g. 0000:2f:00.0)")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def _index(raw: Any, tool: str, where: str) -> int:
    """A device index that must be a non-negative integer (JSON int or digits)."""
    if isinstance(raw, bool):
        raise GpuToolOutputError(tool, f"{where}: GPU index {raw!r} is not a number")
    if isinstance(raw, int) and raw >= 0:
        return raw
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw.strip())
    raise GpuToolOutputError(tool, f"{where}: GPU index {raw!r} is not a non-negative integer")


def _check_unique_indices(gpus: Sequence[Dict[str, Any]], tool: str) -> None:
    seen = set()
    for gpu in gpus:
        if gpu["index"] in seen:
            raise GpuToolOutputError(tool, f"GPU index {gpu['index']} is listed twice")
        seen.add(gpu["index"])


def extract_json_document(text: str, tool: str) -> Any:
    """The first JSON document in a tool's output, ignoring banners before it and anything after it.

    A document starts with `[` or `{` at the start of a line (pretty-printed JSON indents everything else, so a
    truncated document is never mistaken for one of its inner objects). Text after the document (warnings, the
    same block emitted twice by concurrent SLURM tasks) is ignored: the first complete document wins.
    Raises GpuToolOutputError when no line starts a JSON document or none of them is complete.
    """
    decoder = json.JSONDecoder()
    starts = [match.start() for match in re.finditer(r"^[\[{]", text, re.MULTILINE)]
    if not starts:
        raise GpuToolOutputError(tool, f"no JSON in the output: {_excerpt(text)}")
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
    """GPU records (index, uuid, pci_bus) from `amd-smi list --json`.

    Host-side (MxGPU) amd-smi nests virtual functions under `vfs`; those are the guests' devices and are ignored.
    """
    tool = "amd-smi list --json"
    gpus = []
    for entry in _amd_smi_entries(extract_json_document(text, tool), tool):
        index = _index(entry["gpu"], tool, "entry 'gpu'")
        gpus.append(gpu_record(index, uuid=_value(entry.get("uuid")), pci_bus=_pci_bus(entry.get("bdf"), tool)))
    _check_unique_indices(gpus, tool)
    return gpus


def parse_amd_smi_static_json(text: str) -> Dict[int, Dict[str, Optional[str]]]:
    """Per GPU index: `name` (market name), `arch` (gfx target) and `pci_bus`, from `amd-smi static --asic --json`.

    Works on the full `amd-smi static --json` too; sections that are absent or "N/A" give None.
    """
    tool = "amd-smi static --json"
    details: Dict[int, Dict[str, Optional[str]]] = {}
    for entry in _amd_smi_entries(extract_json_document(text, tool), tool):
        index = _index(entry["gpu"], tool, "entry 'gpu'")
        if index in details:
            raise GpuToolOutputError(tool, f"GPU index {index} is listed twice")
        asic = entry.get("asic") if isinstance(entry.get("asic"), dict) else {}
        bus = entry.get("bus") if isinstance(entry.get("bus"), dict) else {}
        details[index] = {
            "name": _value(asic.get("market_name")),
            "arch": _value(asic.get("target_graphics_version")),
            "pci_bus": _pci_bus(bus.get("bdf"), tool),
        }
    return details


def parse_rocm_smi_json(text: str) -> List[Dict[str, Any]]:
    """GPU records from `rocm-smi --showproductname --showbus --showuniqueid --json` (any rocm-smi JSON works).

    Cards are the `cardN` keys (N is rocm-smi's device index); `system` and other keys are not GPUs. The name is
    taken from whichever key this rocm-smi version uses ("Device Name", "Card Series", "Card series").
    An object with no card (`{"system": ...}`, printed when there is no AMD GPU) gives an empty list.
    """
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
        name = next(
            (_value(card.get(k)) for k in ("Device Name", "Card Series", "Card series") if _value(card.get(k))),
            None,
        )
        gpus.append(gpu_record(
            int(match.group(1)),
            name=name,
            uuid=_value(card.get("Unique ID")),
            pci_bus=_pci_bus(card.get("PCI Bus"), tool),
            arch=_value(card.get("GFX Version")),
        ))
    gpus.sort(key=lambda gpu: gpu["index"])
    _check_unique_indices(gpus, tool)
    return gpus


def parse_nvidia_smi_csv(text: str) -> List[Dict[str, Optional[str]]]:
    """Rows of `nvidia-smi --query-gpu=... --format=csv` as dicts keyed by field name.

    Header units are dropped (`memory.total [MiB]` -> `memory.total`), padding after commas is ignored, blank
    lines are skipped and `[N/A]`-style values become None. A row with a different number of fields than the
    header (a cut-off output) is an error, as is output without a header.
    """
    tool = "nvidia-smi --query-gpu"
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise GpuToolOutputError(tool, "empty output (expected a CSV header line)")
    rows = list(csv.reader(lines, skipinitialspace=True))
    header = [_CSV_HEADER_UNIT.sub("", field.strip()) for field in rows[0]]
    if not all(re.match(r"^[A-Za-z_][A-Za-z0-9_.]*$", field) for field in header):
        raise GpuToolOutputError(tool, f"the first line is not a CSV header of field names: {_excerpt(lines[0])}")
    records = []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise GpuToolOutputError(
                tool, f"line {number} has {len(row)} fields but the header has {len(header)} (truncated output?)"
            )
        records.append({field: _value(cell) for field, cell in zip(header, row)})
    return records


def nvidia_gpus_from_rows(rows: Sequence[Dict[str, Optional[str]]]) -> List[Dict[str, Any]]:
    """GPU records from parsed `--query-gpu` rows; the query must include `index` (and should name, uuid, pci.bus_id)."""
    tool = "nvidia-smi --query-gpu"
    gpus = []
    for row in rows:
        if "index" not in row:
            raise GpuToolOutputError(tool, f"the query has no 'index' field (fields: {', '.join(row)})")
        gpus.append(gpu_record(
            _index(row["index"], tool, "field 'index'"),
            name=row.get("name"),
            uuid=row.get("uuid"),
            pci_bus=_pci_bus(row.get("pci.bus_id"), tool),
        ))
    _check_unique_indices(gpus, tool)
    return gpus


def parse_nvidia_smi_list(text: str) -> List[Dict[str, Any]]:
    """GPU records (index, name, uuid, MIG instances) from `nvidia-smi -L`.

    Lines that are neither a GPU nor a MIG line (nvidia-smi prints notices such as an infoROM warning) are
    ignored; output without any GPU line, or a MIG line before the first GPU, is an error.
    """
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
            gpus[-1]["mig_devices"].append(
                {"index": int(mig.group(2)), "profile": mig.group(1), "uuid": mig.group(3)}
            )
    if not gpus:
        raise GpuToolOutputError(tool, f"no 'GPU <n>: <name> (UUID: ...)' line in the output: {_excerpt(text)}")
    _check_unique_indices(gpus, tool)
    return gpus


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
    """The GPU nodes of the KFD topology: `node`, `pci_bus` and `render_node` of each.

    CPU nodes (no SIMDs) are left out. Raises OSError when the topology cannot be read (the KFD driver is not
    loaded, or sysfs is not visible) and GpuToolOutputError when a properties file is malformed.
    """
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
    """(GPU records with `render_node` set from the KFD topology, warnings).

    Matching is by PCI address only. A GPU with no address, no KFD node, or several KFD nodes at its address
    keeps `render_node` None and gets a warning; nothing is paired by position, so lists of different lengths
    cannot shift one GPU onto another's render node.
    """
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


ToolResult = namedtuple("ToolResult", "returncode stdout stderr timed_out")


def run_tool(argv: Sequence[str], timeout: float) -> ToolResult:
    """Run a tool without a shell; on timeout kill its whole process group (it may have started helpers)."""
    try:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as error:
        return ToolResult(127, "", str(error), False)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            stdout, stderr = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            # A helper escaped into its own session and holds the pipes: stop waiting for it.
            process.kill()
            stdout, stderr = b"", b""
        timed_out = True
    return ToolResult(None if timed_out else process.returncode, _decode(stdout), _decode(stderr), timed_out)


def _decode(data: bytes) -> str:
    # The tools print non-ASCII (degree signs, bullets) in whatever encoding; never fail on it.
    return data.decode("utf-8", errors="replace")


class _ToolRunner:
    """Runs the tools found on a search path and turns every failure into a warning."""

    def __init__(self, run: Callable[[Sequence[str], float], ToolResult], search_path: Optional[str],
                 timeout: float, warnings: List[str]):
        self.run = run
        self.search_path = search_path
        self.timeout = timeout
        self.warnings = warnings

    def which(self, tool: str) -> Optional[str]:
        return shutil.which(tool, path=self.search_path)

    def output(self, tool: str, args: Sequence[str]) -> Optional[str]:
        """The tool's stdout, or None (with a warning) when it is missing, times out or fails."""
        executable = self.which(tool)
        if executable is None:
            return None
        command = " ".join([tool, *args])
        result = self.run([executable, *args], self.timeout)
        if result.timed_out:
            self.warnings.append(f"{command} did not answer within {self.timeout:g} s and was stopped")
            return None
        if result.returncode != 0:
            reason = _excerpt(result.stdout + "\n" + result.stderr)
            self.warnings.append(f"{command} failed (exit code {result.returncode}): {reason}")
            return None
        return result.stdout

    def parsed(self, tool: str, args: Sequence[str], parser: Callable[[str], Any]) -> Any:
        """The parsed output of a tool, or None (with a warning)."""
        text = self.output(tool, args)
        if text is None:
            return None
        try:
            return parser(text)
        except GpuToolOutputError as error:
            self.warnings.append(f"cannot read the output of {' '.join([tool, *args])}: {error.problem}")
            return None


def _amd_gpus_from_tools(runner: _ToolRunner) -> List[Dict[str, Any]]:
    """AMD GPUs from amd-smi (names from its static view), else from rocm-smi."""
    gpus = runner.parsed("amd-smi", ["list", "--json"], parse_amd_smi_list_json)
    if gpus:
        details = runner.parsed("amd-smi", ["static", "--asic", "--json"], parse_amd_smi_static_json) or {}
        for gpu in gpus:
            detail = details.get(gpu["index"], {})
            gpu["name"] = detail.get("name")
            gpu["arch"] = detail.get("arch")
            gpu["pci_bus"] = gpu["pci_bus"] or detail.get("pci_bus")
        return gpus
    if gpus == []:
        runner.warnings.append("amd-smi lists no GPUs")
    gpus = runner.parsed("rocm-smi", ["--showproductname", "--showbus", "--showuniqueid", "--json"], parse_rocm_smi_json)
    if gpus == []:
        runner.warnings.append("rocm-smi lists no GPUs")
    return gpus or []


def _rocminfo_reason(runner: _ToolRunner) -> str:
    """rocminfo's own account of why ROCm cannot reach the GPUs ("ROCk module is NOT loaded", /dev/kfd errors)."""
    executable = runner.which("rocminfo")
    if executable is None:
        return ""
    result = runner.run([executable], runner.timeout)
    if result.timed_out or result.returncode == 0:
        return ""
    return "; rocminfo says: " + _excerpt(result.stdout + "\n" + result.stderr)


def _amd_gpus(runner: _ToolRunner, kfd_topology_dir: str) -> List[Dict[str, Any]]:
    gpus = _amd_gpus_from_tools(runner)
    if not gpus:
        return []
    try:
        kfd_nodes = read_kfd_gpu_nodes(kfd_topology_dir)
    except (OSError, GpuToolOutputError) as error:
        runner.warnings.append(
            f"the tools list {len(gpus)} AMD GPU(s) but the KFD topology ({kfd_topology_dir}) is unreadable "
            f"({error}): ROCm cannot use them on this node, so it counts as having no GPUs "
            f"(is the amdgpu driver loaded?){_rocminfo_reason(runner)}"
        )
        return []
    gpus, mapping_warnings = attach_render_nodes(gpus, kfd_nodes)
    runner.warnings.extend(mapping_warnings)
    return gpus


def _nvidia_gpus(runner: _ToolRunner) -> List[Dict[str, Any]]:
    gpus = runner.parsed(
        "nvidia-smi", ["--query-gpu=index,name,uuid,pci.bus_id", "--format=csv"],
        lambda text: nvidia_gpus_from_rows(parse_nvidia_smi_csv(text)),
    )
    if not gpus:
        if gpus == []:
            runner.warnings.append("nvidia-smi lists no GPUs")
        return []
    listing = runner.parsed("nvidia-smi", ["-L"], parse_nvidia_smi_list) or []
    mig_by_uuid = {gpu["uuid"]: gpu["mig_devices"] for gpu in listing}
    for gpu in gpus:
        gpu["mig_devices"] = mig_by_uuid.get(gpu["uuid"], [])
        if gpu["mig_devices"]:
            runner.warnings.append(
                f"GPU {gpu['index']} is in MIG mode with {len(gpu['mig_devices'])} instance(s): a container given "
                "this GPU gets all of them (SLURM MIG allocations are not mapped to single instances)"
            )
    return gpus


def detect_gpus(run: Callable[[Sequence[str], float], ToolResult] = run_tool, search_path: Optional[str] = None,
                kfd_topology_dir: str = KFD_TOPOLOGY_NODES, timeout: float = DEFAULT_TOOL_TIMEOUT) -> Dict[str, Any]:
    """The node's GPUs: `{"vendor": "AMD" | "NVIDIA" | "none", "gpus": [gpu_record...], "warnings": [...]}`.

    AMD is tried first (amd-smi, else rocm-smi, plus the KFD topology for render nodes), then NVIDIA
    (nvidia-smi); the first vendor with GPUs wins. Tools are looked up on `search_path` (default: PATH) and run
    through `run(argv, timeout)`. A missing tool, a tool that fails, hangs or prints something unreadable, no
    driver, or an unreadable KFD topology never raises: the answer is then `none` (or the other vendor) and
    `warnings` says why.
    """
    warnings: List[str] = []
    runner = _ToolRunner(run, search_path, timeout, warnings)
    amd = _amd_gpus(runner, kfd_topology_dir)
    if amd:
        return {"vendor": VENDOR_AMD, "gpus": amd, "warnings": warnings}
    nvidia = _nvidia_gpus(runner)
    if nvidia:
        return {"vendor": VENDOR_NVIDIA, "gpus": nvidia, "warnings": warnings}
    tools = ("amd-smi", "rocm-smi", "nvidia-smi")
    if not any(runner.which(tool) for tool in tools):
        warnings.append(f"none of {', '.join(tools)} is on PATH, so no GPU was detected")
    return {"vendor": VENDOR_NONE, "gpus": [], "warnings": warnings}
