"""The rank-0 image-ready barrier's messages and results: no node leaves the build stage before every node holds the
image rank 0 announced. Rank 0 serves (server.py), every other rank joins (worker.py); docs/contracts.md has the
protocol (JOIN, HELLO, READY, GO, ABORT, each authenticated) and its reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    MAC_PATTERN,
    MAX_LINE_BYTES,
    NONCE_PATTERN,
    WORD_PATTERN,
    ProtocolViolation,
    Session,
    authentic,
    check_word,
    message_mac,
    split_fields,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS

# A lost node should cost minutes, not the job's whole time limit.
DEFAULT_TIMEOUT = float(SETTING_DEFAULTS["barrier_timeout"])
# A dead node drops packets: without a connect timeout a connect hangs for minutes.
DEFAULT_CONNECT_TIMEOUT = 2.0
# How long rank 0 gives a connection to send its READY line before dropping it.
DEFAULT_IDLE_TIMEOUT = 10.0
# How long a worker waits for rank 0's HELLO (after its JOIN) before trying the next candidate port.
DEFAULT_REPLY_TIMEOUT = 5.0
# A worker's pause between rounds over the candidate ports, doubling while rank 0 does not listen yet; short, so a
# worker that arrived first is released soon after rank 0 listens.
MIN_RETRY_PAUSE = 0.05
MAX_RETRY_PAUSE = 0.25
# How often rank 0 asks its `abort_check` whether the run was given up elsewhere (a file read on shared storage).
ABORT_CHECK_INTERVAL = 0.5


@dataclass(frozen=True)
class ReadyMessage:
    """What a worker announces: its rank, its hostname and the ID of the image it holds."""

    rank: int
    hostname: str
    image_id: str


@dataclass(frozen=True)
class Release:
    """Rank 0's authenticated answer to READY: GO with the image rank 0 announced, or ABORT with its reason."""

    go: bool
    image_id: str = ""
    reason: str = ""


@dataclass
class BarrierResult:
    """A released barrier. `workers` is filled on rank 0 only; `rejections` holds, on rank 0, the connections it
    rejected and, on a worker, the replies it refused."""

    port: Optional[int]
    waited_seconds: float
    workers: List[dict] = field(default_factory=list)
    rejections: List[dict] = field(default_factory=list)
    # On rank 0: what held the barrier back without failing it (accept() out of descriptors).
    warnings: List[str] = field(default_factory=list)


def format_hello_line(token: str, session: Session) -> bytes:
    """Rank 0's greeting: its nonce, and its proof of the token over the worker's nonce."""
    return f"HELLO {session.rank0_nonce} {message_mac(token, 'HELLO', session)}\n".encode("ascii")


def parse_hello_line(line: bytes, token: str, job_id: str, rank: int, hostname: str, worker_nonce: str) -> Session:
    """A worker's check of rank 0's greeting (newline stripped): the connection's session, or ProtocolViolation."""
    _, rank0_nonce, mac = split_fields(line, "HELLO", 3)
    if not NONCE_PATTERN.match(rank0_nonce) or not MAC_PATTERN.match(mac):
        raise ProtocolViolation("malformed HELLO: the nonce or the MAC is not lowercase hex of the right length")
    session = Session(job_id, rank, hostname, rank0_nonce, worker_nonce)
    if not authentic(mac, token, "HELLO", session):
        raise ProtocolViolation(
            "HELLO failed authentication: not this run's rank 0 (another job's barrier, or an impostor)"
        )
    return session


def format_ready_line(token: str, session: Session, image_id: str) -> bytes:
    """The READY line a worker sends for the image it holds, newline included."""
    check_word(image_id, "image_id")
    return f"READY {image_id} {message_mac(token, 'READY', session, image_id)}\n".encode("ascii")


def parse_ready_line(line: bytes, token: str, session: Session) -> ReadyMessage:
    """Rank 0's check of a READY line (newline stripped), its MAC first; ProtocolViolation when it fails."""
    _, image_id, mac = split_fields(line, "READY", 3)
    if not MAC_PATTERN.match(mac) or not authentic(mac, token, "READY", session, image_id):
        raise ProtocolViolation(
            f"rank {session.rank}: READY failed authentication (wrong token, or a line replayed from another "
            "connection)"
        )
    if not WORD_PATTERN.match(image_id):
        raise ProtocolViolation(f"rank {session.rank}: empty or non-printable image ID")
    return ReadyMessage(session.rank, session.hostname, image_id)


def format_go_line(token: str, session: Session, image_id: str) -> bytes:
    """Rank 0's release, carrying the image it announced, newline included."""
    return f"GO {image_id} {message_mac(token, 'GO', session, image_id)}\n".encode("ascii")


def format_abort_line(token: str, session: Session, reason: str) -> bytes:
    """Rank 0's ABORT with its reason, made printable ASCII and cut to fit the line, newline included."""
    room = MAX_LINE_BYTES - len("ABORT  \n") - 64
    reason = "".join(char if " " <= char <= "~" else "?" for char in reason)[:room]
    return f"ABORT {message_mac(token, 'ABORT', session, reason)} {reason}\n".encode("ascii")


def parse_release_line(line: bytes, token: str, session: Session) -> Release:
    """A worker's check of rank 0's answer to READY (newline stripped): GO or ABORT, authenticated."""
    if line.startswith(b"GO "):
        _, image_id, mac = split_fields(line, "GO", 3)
        if not MAC_PATTERN.match(mac) or not authentic(mac, token, "GO", session, image_id):
            raise ProtocolViolation("GO failed authentication: not from this run's rank 0 (an impostor?)")
        return Release(go=True, image_id=image_id)
    if line.startswith(b"ABORT "):
        _, mac, reason = split_fields(line, "ABORT", 3, maxsplit=2)
        if not MAC_PATTERN.match(mac) or not authentic(mac, token, "ABORT", session, reason):
            raise ProtocolViolation("ABORT failed authentication: not from this run's rank 0 (an impostor?)")
        return Release(go=False, reason=reason)
    raise ProtocolViolation("an unexpected reply to READY, neither GO nor ABORT (not a rank barrier?)")
