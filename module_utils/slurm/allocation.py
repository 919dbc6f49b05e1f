"""The SLURM allocation a run happens in: its nodes in allocation order, ranks, and the rendezvous address/port.
Controller side only (python-hostlist, which the nodes need not have)."""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

MASTER_PORT_BASE = 29500
MASTER_PORT_SPAN = 2000


class AllocationError(UserError):
    """The SLURM environment describes no usable allocation; the message names the variable and the value."""


_SLURM_JOB_ID = re.compile(r"^[0-9]+(?:[_+][0-9]+)?$")


def is_slurm_job_id(job_id: Any) -> bool:
    """True for an ID SLURM hands out: 4242, an array task 4242_7, a heterogeneous job's component 4242+1."""
    return isinstance(job_id, str) and bool(_SLURM_JOB_ID.match(job_id))


def slurm_job_id_from_env(environ: Mapping[str, str]) -> Optional[str]:
    """This allocation's job ID (``SLURM_JOB_ID``, else the older ``SLURM_JOBID``), None outside SLURM."""
    job_id = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not job_id:
        return None
    if not is_slurm_job_id(job_id):
        raise AllocationError(
            f"SLURM_JOB_ID={job_id!r} is not a job number SLURM gives (4242, 4242_7 or 4242+1): "
            "unset it outside an allocation"
        )
    return job_id


@dataclass
class Allocation:
    """The nodes of one allocation, rank 0 first."""

    nodes: list
    job_id: str | None
    master_addr: str | None
    master_port: int
    node_addresses: dict = field(default_factory=dict)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    def job_vars(self) -> dict:
        """The variables every node shares, set once on the inventory's `all` group: copied to every host, a large
        allocation's node list would cost time and memory growing with the square of the node count."""
        return {
            "nnodes": self.nnodes,
            "master_addr": self.master_addr or "",
            "master_port": self.master_port,
            "slurm_job_id": self.job_id or "",
            "allocation_nodes": list(self.nodes),
            # The site config's addresses of this allocation's nodes (sglang-disagg's node list), no others.
            "node_addresses": {node: self.node_addresses[node] for node in self.nodes if node in self.node_addresses},
        }

    def ranks(self) -> dict:
        """Each node's rank (``node_rank``), rank 0 first."""
        return {node: rank for rank, node in enumerate(self.nodes)}


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST", allow_duplicates: bool = False) -> list:
    """Expand a SLURM hostlist expression (``gpu[001-004,010],login1``) in allocation order; a node named twice is
    refused unless ``allow_duplicates`` (an option's list, where SLURM takes it once)."""
    import hostlist

    text = (nodelist or "").strip()
    if not text:
        raise AllocationError(f"{variable} is empty; run inside an allocation (salloc/sbatch) or unset it")
    if "" in _top_level_items(text):
        # python-hostlist skips an empty item; SLURM refuses the list.
        raise AllocationError(
            f"{variable}={nodelist!r} is not a valid hostlist (an empty name between commas, or a comma at an end); "
            "expected e.g. 'gpu[001-004,010],login1'"
        )
    try:
        nodes = hostlist.expand_hostlist(text, allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        raise AllocationError(
            f"{variable}={nodelist!r} is not a valid hostlist ({exc}); expected e.g. 'gpu[001-004,010],login1'"
        ) from None
    if not nodes or any(not node or any(c.isspace() for c in node) for node in nodes):
        raise AllocationError(f"{variable}={nodelist!r} expands to an empty or blank host name")
    duplicates = sorted({node for node in nodes if nodes.count(node) > 1})
    if duplicates and not allow_duplicates:
        raise AllocationError(f"{variable}={nodelist!r} names {', '.join(duplicates)} more than once")
    return nodes


def _top_level_items(text: str) -> list:
    """The comma-separated items of a hostlist outside its brackets (``a[1,2],b`` -> ``a[1,2]``, ``b``)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return items + [current.strip()]


def default_master_port(job_id: str | None) -> int:
    """A rendezvous port derived from the job ID, so two jobs sharing a node do not collide."""
    if not job_id:
        return MASTER_PORT_BASE
    # An array task or heterogeneous component (4242_7, 4242+1) shares its job's number: hash the whole ID.
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode("utf-8"))
    return MASTER_PORT_BASE + number % MASTER_PORT_SPAN


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def explicit_master_addr(env, node_addresses: dict, rank0: str) -> str | None:
    """MASTER_ADDR when it is given as an IP, else the site config's address of rank 0, else None: rank 0 then
    resolves its own address (the preparation stage), since the controller may see other names."""
    given = (env.get("MASTER_ADDR") or "").strip()
    if given:
        try:
            ipaddress.ip_address(given)
        except ValueError:
            # A name: only rank 0 can say what it resolves to there; refuse nothing yet.
            return None
        return given
    return node_addresses.get(rank0)


def allocation_from_env(env, node_addresses: dict | None = None) -> Allocation:
    """The allocation described by SLURM's variables; outside any allocation, localhost as a one-node run."""
    node_addresses = dict(node_addresses or {})
    job_id = slurm_job_id_from_env(env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist is None:
        return Allocation(
            ["localhost"], job_id, env.get("MASTER_ADDR") or "127.0.0.1", _port_from_env(env, job_id), node_addresses
        )
    nodes = expand_nodelist(nodelist)
    count_var = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
    count = env.get(count_var)
    if count is not None:
        if not count.strip().isdigit():
            raise AllocationError(f"{count_var}={count!r} is not a node count")
        if int(count) != len(nodes):
            raise AllocationError(
                f"{count_var}={count} disagrees with SLURM_JOB_NODELIST={nodelist!r}, which names {len(nodes)} "
                "nodes; the environment mixes two allocations (unset the stale variables)"
            )
    master = explicit_master_addr(env, node_addresses, nodes[0])
    return Allocation(nodes, job_id, master, _port_from_env(env, job_id), node_addresses)


def _port_from_env(env, job_id) -> int:
    given = (env.get("MASTER_PORT") or "").strip()
    if not given:
        return default_master_port(job_id)
    if not given.isdigit() or not 1 <= int(given) <= 65535:
        raise AllocationError(f"MASTER_PORT={given!r} is not a TCP port (1-65535)")
    return int(given)


def routable_addresses(hostname: str) -> list:
    """The non-loopback IPv4 addresses a host name resolves to (the Debian ``127.0.1.1 hostname`` trap excluded)."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = []
    for info in infos:
        address = info[4][0]
        if not is_loopback(address) and address not in addresses:
            addresses.append(address)
    return addresses


# One slow or failed answer of slurmctld must decide nothing: squeue is asked again, a bounded few times.
SQUEUE_TIMEOUT = 10.0
SQUEUE_ATTEMPTS = 3
SQUEUE_RETRY_PAUSE = 1.0


def squeue_job_end(job_id: str) -> str:
    """``squeue -h -j <job> -o %e``: the job's end as SLURM prints it; empty when unknown or squeue failed (never
    fatal: the sbatch script's early warning still stops the model before the time limit)."""
    return squeue_job_field(job_id, "%e")[0]


def squeue_job_start(job_id: str) -> str:
    """``squeue -h -j <job> -o %S``: when SLURM started the job, as it prints it; empty when unknown."""
    return squeue_job_field(job_id, "%S")[0]


def squeue_job_field(job_id: str, field: str) -> Tuple[str, Optional[str]]:
    """``squeue -h -j <job> -o <field>``: (what SLURM printed, None), or ("", why it is unknown). A squeue that
    fails or outlives SQUEUE_TIMEOUT is asked again, SQUEUE_ATTEMPTS times in all (about 32 s at most)."""
    if not job_id:
        return "", None
    argv = ["squeue", "-h", "-j", str(job_id), "-o", field]
    problem = ""
    for attempt in range(SQUEUE_ATTEMPTS):
        if attempt:
            time.sleep(SQUEUE_RETRY_PAUSE)
        try:
            answer = subprocess.run(argv, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT)
        except FileNotFoundError:
            return "", "there is no squeue on PATH"
        except OSError as error:
            problem = f"{' '.join(argv)} could not run: {error.strerror or error}"
            continue
        except subprocess.TimeoutExpired:
            problem = f"{' '.join(argv)} did not answer within {SQUEUE_TIMEOUT:g} s"
            continue
        if answer.returncode == 0:
            return answer.stdout.strip(), None
        said = (answer.stderr.strip() or answer.stdout.strip() or "nothing").splitlines()[-1][:300]
        problem = f"{' '.join(argv)} exited {answer.returncode}: {said}"
    return "", f"{problem}, on each of {SQUEUE_ATTEMPTS} tries"
