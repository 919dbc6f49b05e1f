"""The GPU vendor and devices of a node: which vendor's tools to believe, run with a timeout, never failing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections import namedtuple
from typing import Any, Callable, Dict, List, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.amd_tools import (
    parse_amd_smi_list_json,
    parse_amd_smi_static_json,
    parse_rocm_smi_json,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.kfd_topology import (
    KFD_TOPOLOGY_NODES,
    attach_render_nodes,
    read_kfd_gpu_nodes,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.nvidia_tools import (
    nvidia_gpus_from_rows,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_list,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.records import GpuToolOutputError, output_excerpt

VENDOR_AMD = "AMD"
VENDOR_NVIDIA = "NVIDIA"
VENDOR_NONE = "none"

DEFAULT_TOOL_TIMEOUT = 30.0


ToolResult = namedtuple("ToolResult", "returncode stdout stderr timed_out")


def run_tool(argv: Sequence[str], timeout: float) -> ToolResult:
    """Run a tool without a shell; on timeout kill its whole process group (it may have started helpers)."""
    try:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as error:
        return ToolResult(127, "", str(error), False)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            stdout, stderr = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            # A helper escaped into its own session and holds the pipes: stop waiting for it.
            process.kill()
            stdout, stderr = b"", b""
        timed_out = True
    # The tools print non-ASCII (degree signs, bullets) in whatever encoding; never fail on it.
    stdout, stderr = stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace")
    return ToolResult(None if timed_out else process.returncode, stdout, stderr, timed_out)


class _ToolRunner:
    """Runs the tools found on a search path and turns every failure into a warning."""

    def __init__(self, search_path: Optional[str], timeout: float, warnings: List[str]):
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
        result = run_tool([executable, *args], self.timeout)
        if result.timed_out:
            self.warnings.append(f"{command} did not answer within {self.timeout:g} s and was stopped")
            return None
        if result.returncode != 0:
            reason = output_excerpt(result.stdout + "\n" + result.stderr)
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
    gpus = runner.parsed(
        "rocm-smi", ["--showproductname", "--showbus", "--showuniqueid", "--json"], parse_rocm_smi_json
    )
    if gpus == []:
        runner.warnings.append("rocm-smi lists no GPUs")
    return gpus or []


def _rocminfo_reason(runner: _ToolRunner) -> str:
    """rocminfo's own account of why ROCm cannot reach the GPUs ("ROCk module is NOT loaded", /dev/kfd errors)."""
    executable = runner.which("rocminfo")
    if executable is None:
        return ""
    result = run_tool([executable], runner.timeout)
    if result.timed_out or result.returncode == 0:
        return ""
    return "; rocminfo says: " + output_excerpt(result.stdout + "\n" + result.stderr)


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
        "nvidia-smi",
        ["--query-gpu=index,name,uuid,pci.bus_id", "--format=csv"],
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


def detect_gpus(
    search_path: Optional[str] = None, kfd_topology_dir: str = KFD_TOPOLOGY_NODES, timeout: float = DEFAULT_TOOL_TIMEOUT
) -> Dict[str, Any]:
    """The node's GPUs: `{"vendor": "AMD" | "NVIDIA" | "none", "gpus": [...], "warnings": [...]}`; never raises."""
    warnings: List[str] = []
    runner = _ToolRunner(search_path, timeout, warnings)
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
