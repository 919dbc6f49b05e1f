"""The rank-0 barrier's wire: its ports (derived from the job, no message exchanged), lines and MACs."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import BarrierConfigError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS

DEFAULT_PORT_RANGE = tuple(SETTING_DEFAULTS["barrier_port_range"])
DEFAULT_PORT_CANDIDATES = 3
# Every field is at most 255 characters, so every line the protocol makes fits; a longer one is a foreign peer's.
MAX_LINE_BYTES = 512
# Random bytes in each side's nonce: enough that a nonce never repeats in practice.
NONCE_BYTES = 16
# The MACs' domain: a MAC of this protocol is never valid in another one that shares a token format.
PROTOCOL = "slurm-multi rank barrier 2"

WORD_PATTERN = re.compile(r"[!-~]{1,255}\Z")  # printable ASCII without spaces: token, hostname, image ID
RANK_PATTERN = re.compile(r"(0|[1-9][0-9]{0,8})\Z")  # no sign, no padding, no underscores: int() accepts all three
NONCE_PATTERN = re.compile(rf"[0-9a-f]{{{2 * NONCE_BYTES}}}\Z")
MAC_PATTERN = re.compile(r"[0-9a-f]{64}\Z")  # hex HMAC-SHA256

_LOGGER = logging.getLogger(__name__)


class ProtocolViolation(Exception):
    """A line the protocol does not accept at this point; `reason` says why and never quotes the line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Session:
    """One connection's handshake: what every MAC sent on it covers besides the message itself."""

    job_id: str
    rank: int
    hostname: str
    rank0_nonce: str
    worker_nonce: str


def parse_port_range(value) -> Tuple[int, int]:
    """`"20000-29999"` or a (low, high) pair -> (low, high), both bindable by an unprivileged user."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
        pair = (int(match.group(1)), int(match.group(2))) if match else None
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        pair = (value[0], value[1])
    else:
        pair = None
    if pair is None or not 1024 <= pair[0] <= pair[1] <= 65535:
        raise BarrierConfigError(
            f"port_range must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535 (e.g. 20000-29999), got {value!r}"
        )
    return pair


def derive_barrier_ports(
    master_port: int, job_id, port_range=DEFAULT_PORT_RANGE, count: int = DEFAULT_PORT_CANDIDATES
) -> List[int]:
    """The barrier's candidate ports for a job, the same on every node, in the order rank 0 tries to bind them: a hash
    spread over the range (MASTER_PORT is often derived from the job ID), skipping MASTER_PORT itself."""
    low, high = parse_port_range(port_range)
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise BarrierConfigError(f"master_port must be an integer port number 1-65535, got {master_port!r}")
    span = high - low + 1
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count < span:
        raise BarrierConfigError(
            f"port_candidates must be an integer from 1 to {span - 1} for port_range {low}-{high}, got {count!r}"
        )
    digest = hashlib.sha256(f"{master_port}/{job_id}".encode()).digest()
    offset = int.from_bytes(digest[:8], "big") % span
    stride = span // count
    ports = []
    for index in range(count):
        port = low + (offset + index * stride) % span
        if port == master_port:
            port = low + (port - low + 1) % span
        ports.append(port)
    return ports


def raise_open_files_limit(needed: int, logger: Optional[logging.Logger] = None) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit when below `needed` (one per worker); the new limit."""
    import resource  # POSIX only; imported here so that the protocol helpers import anywhere

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        (logger or _LOGGER).warning(
            "open files limit is %d (hard), below the %d descriptors this barrier may need: "
            "raise `ulimit -Hn` on the node",
            target,
            needed,
        )
    return target


def check_word(value, what: str) -> str:
    if not isinstance(value, str) or not WORD_PATTERN.match(value):
        raise BarrierConfigError(f"{what} must be 1-255 printable ASCII characters without spaces, got {value!r}")
    return value


def check_token(token) -> str:
    # Never quote the token: a near-miss is still a secret.
    if not isinstance(token, str) or not WORD_PATTERN.match(token):
        raise BarrierConfigError("the barrier token must be 1-255 printable ASCII characters without spaces")
    return token


def check_job_id(job_id) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise BarrierConfigError(f"job_id must be a non-empty string (the SLURM job ID), got {job_id!r}")
    return job_id


def check_nnodes(nnodes) -> int:
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise BarrierConfigError(f"nnodes must be a positive integer, got {nnodes!r}")
    return nnodes


def new_nonce() -> str:
    """A fresh nonce for one connection (hex): the challenge the other side's MAC must cover."""
    return os.urandom(NONCE_BYTES).hex()


def message_mac(token: str, kind: str, session: Session, *fields: str) -> str:
    """HMAC-SHA256 (hex) under the token over the message type, the session (job, rank, hostname, both nonces) and the
    fields, each length-prefixed: no MAC is valid for the other side or on another connection."""
    parts = (
        PROTOCOL,
        kind,
        session.job_id,
        str(session.rank),
        session.hostname,
        session.rank0_nonce,
        session.worker_nonce,
    ) + fields
    data = b"".join(b"%d:%s" % (len(part), part) for part in (text.encode("utf-8") for text in parts))
    # The constructor, not the name "sha256": with OpenSSL 3 a name is looked up again on every call.
    return hmac.digest(token.encode("ascii"), data, hashlib.sha256).hex()


def authentic(offered: str, token: str, kind: str, session: Session, *fields: str) -> bool:
    return hmac.compare_digest(offered, message_mac(token, kind, session, *fields))


def split_fields(line: bytes, kind: str, count: int, maxsplit: int = -1) -> List[str]:
    """A line's space-separated fields, checked to be a `kind` line of `count` fields."""
    try:
        fields = line.decode("ascii").split(" ", maxsplit)
    except UnicodeDecodeError:
        raise ProtocolViolation("garbage: not an ASCII line") from None
    if fields[0] != kind:
        raise ProtocolViolation(f"garbage: not a {kind} line")
    if len(fields) != count:
        raise ProtocolViolation(f"malformed {kind}: {len(fields)} space-separated fields instead of {count}")
    return fields


def take_line(buffer: bytearray) -> Optional[bytes]:
    """The first whole line in `buffer`, without its newline and taken out of it; None while there is none."""
    end = buffer.find(b"\n")
    if end < 0:
        return None
    line = bytes(buffer[:end])
    del buffer[: end + 1]
    return line


def format_join_line(rank: int, hostname: str, worker_nonce: str) -> bytes:
    """A worker's first line: its rank, its hostname and its nonce. Nothing in it depends on the token."""
    return f"JOIN {rank} {check_word(hostname, 'hostname')} {worker_nonce}\n".encode("ascii")


def parse_join_line(line: bytes, nnodes: int) -> Tuple[int, str, str]:
    """Rank 0's check of a JOIN line (newline stripped): (rank, hostname, worker nonce), or ProtocolViolation."""
    _, rank_text, hostname, worker_nonce = split_fields(line, "JOIN", 4)
    if not RANK_PATTERN.match(rank_text):
        raise ProtocolViolation("rank is not a plain decimal integer")
    rank = int(rank_text)
    if not 0 < rank < nnodes:
        raise ProtocolViolation(f"rank {rank} out of range: workers are ranks 1..{nnodes - 1}")
    if not WORD_PATTERN.match(hostname):
        raise ProtocolViolation(f"rank {rank}: empty or non-printable hostname")
    if not NONCE_PATTERN.match(worker_nonce):
        raise ProtocolViolation(f"rank {rank}: the nonce is not {2 * NONCE_BYTES} lowercase hex digits")
    return rank, hostname, worker_nonce


def format_peer(address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_master_addr(master_addr) -> str:
    try:
        address = ipaddress.ip_address(str(master_addr))
    except ValueError:
        raise BarrierConfigError(
            f"master_addr must be an IP address (rank 0's address on the nodes' network), got {master_addr!r}"
        ) from None
    return str(address)
