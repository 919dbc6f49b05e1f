"""The rank-0 image-ready barrier: no node leaves the build stage before every node holds the image rank 0 announced.

Rank 0 serves, every other rank joins. Standard library only and independent of Ansible, so that the
`rank_barrier` module and the planned pull mode (one `ansible-playbook -c local` per node, no task boundary
between nodes) share this code.

Protocol: one ASCII line per message, at most MAX_LINE_BYTES including the newline (docs/contracts.md):

    worker -> rank 0   JOIN <rank> <hostname> <worker-nonce>
    rank 0 -> worker   HELLO <rank0-nonce> <mac>                  proves rank 0 holds the token
    worker -> rank 0   READY <image-id> <mac>                     proves the worker holds it
    rank 0 -> worker   GO <image-id> <mac>                        every rank arrived with this image
    rank 0 -> worker   ABORT <mac> <reason>                       a node has another image, or rank 0 gave up

Each side proves it holds the per-run token by an HMAC-SHA256 (hex) that covers the other side's fresh nonce;
the token itself never travels. Every MAC also covers its message type (so one side's MAC is never valid as the
other's), the job ID, the worker's rank and hostname, both nonces and the message's fields, so nothing seen on
one connection is accepted on another. Everything a MAC covers except the image is known once JOIN is answered,
so both sides make the lines they expect next (READY for rank 0's image, GO) then, and checking one inside the
barrier's window is a single comparison. A worker announces itself only to a listener whose HELLO proved the token:
barrier ports are derived from the job and can collide with another service's or another job's barrier, or be
taken first by a local user pretending to be rank 0. Such a listener costs the worker one reply timeout and learns
nothing it could use; a GO or ABORT that fails authentication is ignored (the worker tries the next candidate
port). What a listener that relays to the real rank 0 can still do is withhold its GO (docs/contracts.md). A
rejected connection is closed without a reply, and rank 0 reports the reason with the peer's address.

Rank 0 is one thread around a selector: a slow, idle or hostile connection never delays the honest workers,
and a thousand connections cost a thousand sockets, not a thousand threads.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_PORT_RANGE = (20000, 29999)
DEFAULT_PORT_CANDIDATES = 3
# A lost node should cost minutes, not the job's whole time limit.
DEFAULT_TIMEOUT = 600.0
# A dead node drops packets: without a connect timeout a connect hangs for minutes.
DEFAULT_CONNECT_TIMEOUT = 2.0
# How long rank 0 gives a connection to send its READY line before dropping it.
DEFAULT_IDLE_TIMEOUT = 10.0
# How long a worker waits for rank 0's HELLO (after its JOIN) before trying the next candidate port.
DEFAULT_REPLY_TIMEOUT = 5.0
# A worker's pause between rounds over the candidate ports, doubling while rank 0 does not listen yet; at most a
# quarter second, so a worker that arrived first is released within that of rank 0 listening (a refused connect
# on a closed port costs rank 0's node nothing).
MIN_RETRY_PAUSE = 0.05
MAX_RETRY_PAUSE = 0.25
# How often rank 0 asks its `abort_check` whether the run was given up elsewhere (a file read on shared storage).
ABORT_CHECK_INTERVAL = 0.5
# Every field is at most 255 characters, so every line the protocol makes fits; a longer one is a foreign peer's.
MAX_LINE_BYTES = 512
# Random bytes in each side's nonce: enough that a nonce never repeats in practice.
NONCE_BYTES = 16
# The MACs' domain: a MAC of this protocol is never valid in another one that shares a token format.
PROTOCOL = "slurm-multi rank barrier 2"
# Rank 0 logs every rejection but keeps only this many for its result, so a flood cannot exhaust its memory.
MAX_REPORTED_REJECTIONS = 256
# The kernel caps this at net.core.somaxconn; it must hold every worker connecting at once.
LISTEN_BACKLOG = 4096
# Descriptors rank 0 needs beyond one per worker: listener, selector, stray connections, the interpreter's own.
SPARE_DESCRIPTORS = 128
# How long rank 0 stops accepting after accept() ran out of descriptors, doubling while it keeps failing: a closed
# connection frees one, and the workers' connections wait in the backlog meanwhile.
ACCEPT_PAUSE_FIRST = 0.05
ACCEPT_PAUSE_MAX = 1.0

_WORD = re.compile(r"[!-~]{1,255}\Z")  # printable ASCII without spaces: token, hostname, image ID
_RANK = re.compile(r"(0|[1-9][0-9]{0,8})\Z")  # no sign, no padding, no underscores: int() accepts all three
_NONCE = re.compile(rf"[0-9a-f]{{{2 * NONCE_BYTES}}}\Z")
_MAC = re.compile(r"[0-9a-f]{64}\Z")  # hex HMAC-SHA256

_LOGGER = logging.getLogger(__name__)


class BarrierError(Exception):
    """The barrier did not release: the message says why and what to check."""

    def __init__(self, message: str, rejections: Sequence[dict] = ()):
        super().__init__(message)
        self.rejections = list(rejections)


class BarrierConfigError(BarrierError, ValueError):
    """A barrier setting that cannot work as given (bad port range, rank, address, token shape...)."""


class BarrierTimeout(BarrierError):
    """The deadline passed; on rank 0, `missing` lists the ranks that never arrived as (rank, hostname or None)."""

    def __init__(self, message: str, missing: Sequence[Tuple[int, Optional[str]]] = (), rejections=()):
        super().__init__(message, rejections)
        self.missing = list(missing)


class BarrierAborted(BarrierError):
    """The barrier was given up: rank 0 aborted it (a node has another image, or its deadline passed), or the
    worker's `abort_check` reported that the run ended elsewhere (rank 0 could not open the barrier)."""

    def __init__(self, message: str, reason: str, rejections=()):
        super().__init__(message, rejections)
        self.reason = reason


class ProtocolViolation(Exception):
    """A line the protocol does not accept at this point; `reason` says why and never quotes the line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ReadyMessage:
    """What a worker announces: its rank, its hostname and the ID of the image it holds."""

    rank: int
    hostname: str
    image_id: str


@dataclass(frozen=True)
class Session:
    """One connection's handshake: what every MAC sent on it covers besides the message itself."""

    job_id: str
    rank: int
    hostname: str
    rank0_nonce: str
    worker_nonce: str


@dataclass(frozen=True)
class Release:
    """Rank 0's authenticated answer to READY: GO with the image rank 0 announced, or ABORT with its reason."""

    go: bool
    image_id: str = ""
    reason: str = ""


@dataclass
class BarrierResult:
    """A released barrier. `workers` is filled on rank 0 only; `rejections` holds, on rank 0, the connections it
    rejected and, on a worker, the replies it refused (a greeting, GO or ABORT that failed authentication)."""

    port: Optional[int]
    waited_seconds: float
    workers: List[dict] = field(default_factory=list)
    rejections: List[dict] = field(default_factory=list)
    # On rank 0: what held the barrier back without failing it (accept() out of descriptors).
    warnings: List[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------- ports


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
    """The barrier's candidate ports for a job, in the order rank 0 tries to bind them and workers connect.

    Every node computes the same list from MASTER_PORT and SLURM_JOB_ID alone, with no message exchanged. A
    hash, not a sum: MASTER_PORT is often derived from the job ID itself. Candidates are spread over the range
    so that two jobs whose first candidates collide are unlikely to collide on the next. MASTER_PORT itself is
    skipped: the model's own rendezvous binds it right after the barrier.
    """
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
    """Raise this process's soft RLIMIT_NOFILE towards the hard limit when it is below `needed`; the new soft limit.

    Each worker costs rank 0 one descriptor, and a distro's default soft limit (1024) is below a large run's
    node count.
    """
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


# ------------------------------------------------------------------------------------------------------- protocol


def _check_word(value, what: str) -> str:
    if not isinstance(value, str) or not _WORD.match(value):
        raise BarrierConfigError(f"{what} must be 1-255 printable ASCII characters without spaces, got {value!r}")
    return value


def _check_token(token) -> str:
    # Never quote the token: a near-miss is still a secret.
    if not isinstance(token, str) or not _WORD.match(token):
        raise BarrierConfigError("the barrier token must be 1-255 printable ASCII characters without spaces")
    return token


def _check_job_id(job_id) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise BarrierConfigError(f"job_id must be a non-empty string (the SLURM job ID), got {job_id!r}")
    return job_id


def _check_nnodes(nnodes) -> int:
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise BarrierConfigError(f"nnodes must be a positive integer, got {nnodes!r}")
    return nnodes


def new_nonce() -> str:
    """A fresh nonce for one connection (hex): the challenge the other side's MAC must cover."""
    return os.urandom(NONCE_BYTES).hex()


def message_mac(token: str, kind: str, session: Session, *fields: str) -> str:
    """HMAC-SHA256 (hex) under the token over the message type, the session (job, rank, hostname, both nonces)
    and the message's own fields.

    The type keeps a MAC one side sends from being valid as one the other side sends; the nonces keep one
    connection's MACs from being valid on another. Every part is length-prefixed, so that no two different
    lists of parts hash the same bytes.
    """
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
    # The constructor, not the name "sha256": with OpenSSL 3 a name is looked up again on every call, 8x slower.
    return hmac.digest(token.encode("ascii"), data, hashlib.sha256).hex()


def _authentic(offered: str, token: str, kind: str, session: Session, *fields: str) -> bool:
    return hmac.compare_digest(offered, message_mac(token, kind, session, *fields))


def _fields(line: bytes, kind: str, count: int, maxsplit: int = -1) -> List[str]:
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


def format_join_line(rank: int, hostname: str, worker_nonce: str) -> bytes:
    """A worker's first line: its rank, its hostname and its nonce. Nothing in it depends on the token."""
    return f"JOIN {rank} {_check_word(hostname, 'hostname')} {worker_nonce}\n".encode("ascii")


def parse_join_line(line: bytes, nnodes: int) -> Tuple[int, str, str]:
    """Rank 0's check of a JOIN line (newline stripped): (rank, hostname, worker nonce), or ProtocolViolation."""
    _, rank_text, hostname, worker_nonce = _fields(line, "JOIN", 4)
    if not _RANK.match(rank_text):
        raise ProtocolViolation("rank is not a plain decimal integer")
    rank = int(rank_text)
    if not 0 < rank < nnodes:
        raise ProtocolViolation(f"rank {rank} out of range: workers are ranks 1..{nnodes - 1}")
    if not _WORD.match(hostname):
        raise ProtocolViolation(f"rank {rank}: empty or non-printable hostname")
    if not _NONCE.match(worker_nonce):
        raise ProtocolViolation(f"rank {rank}: the nonce is not {2 * NONCE_BYTES} lowercase hex digits")
    return rank, hostname, worker_nonce


def format_hello_line(token: str, session: Session) -> bytes:
    """Rank 0's greeting: its nonce, and its proof of the token over the worker's nonce."""
    return f"HELLO {session.rank0_nonce} {message_mac(token, 'HELLO', session)}\n".encode("ascii")


def parse_hello_line(line: bytes, token: str, job_id: str, rank: int, hostname: str, worker_nonce: str) -> Session:
    """A worker's check of rank 0's greeting (newline stripped): the connection's session, or ProtocolViolation."""
    _, rank0_nonce, mac = _fields(line, "HELLO", 3)
    if not _NONCE.match(rank0_nonce) or not _MAC.match(mac):
        raise ProtocolViolation("malformed HELLO: the nonce or the MAC is not lowercase hex of the right length")
    session = Session(job_id, rank, hostname, rank0_nonce, worker_nonce)
    if not _authentic(mac, token, "HELLO", session):
        raise ProtocolViolation(
            "HELLO failed authentication: not this run's rank 0 (another job's barrier, or an impostor)"
        )
    return session


def format_ready_line(token: str, session: Session, image_id: str) -> bytes:
    """The READY line a worker sends for the image it holds, newline included."""
    _check_word(image_id, "image_id")
    return f"READY {image_id} {message_mac(token, 'READY', session, image_id)}\n".encode("ascii")


def parse_ready_line(line: bytes, token: str, session: Session) -> ReadyMessage:
    """Rank 0's check of a READY line (newline stripped) on a greeted connection; raise ProtocolViolation.

    The MAC is checked, in constant time, before anything else about the line.
    """
    _, image_id, mac = _fields(line, "READY", 3)
    if not _MAC.match(mac) or not _authentic(mac, token, "READY", session, image_id):
        raise ProtocolViolation(
            f"rank {session.rank}: READY failed authentication (wrong token, or a line replayed from another "
            "connection)"
        )
    if not _WORD.match(image_id):
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
    """A worker's check of rank 0's answer to READY (newline stripped): GO or ABORT, authenticated, or
    ProtocolViolation (an impostor's, or garbage)."""
    if line.startswith(b"GO "):
        _, image_id, mac = _fields(line, "GO", 3)
        if not _MAC.match(mac) or not _authentic(mac, token, "GO", session, image_id):
            raise ProtocolViolation("GO failed authentication: not from this run's rank 0 (an impostor?)")
        return Release(go=True, image_id=image_id)
    if line.startswith(b"ABORT "):
        _, mac, reason = _fields(line, "ABORT", 3, maxsplit=2)
        if not _MAC.match(mac) or not _authentic(mac, token, "ABORT", session, reason):
            raise ProtocolViolation("ABORT failed authentication: not from this run's rank 0 (an impostor?)")
        return Release(go=False, reason=reason)
    raise ProtocolViolation("an unexpected reply to READY, neither GO nor ABORT (not a rank barrier?)")


def _format_peer(address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_master_addr(master_addr) -> str:
    try:
        address = ipaddress.ip_address(str(master_addr))
    except ValueError:
        raise BarrierConfigError(
            f"master_addr must be an IP address (rank 0's address on the nodes' network), got {master_addr!r}"
        ) from None
    return str(address)


# ---------------------------------------------------------------------------------------------------------- rank 0


class _Connection:
    """One accepted socket. `session`, `expected_ready` (the READY line for rank 0's image, newline stripped) and
    `go_line` are set once its JOIN was answered with HELLO; `message` and `arrived` (monotonic time) once its
    READY was accepted."""

    __slots__ = ("sock", "peer", "buffer", "session", "expected_ready", "message", "arrived", "go_line", "closed")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.buffer = bytearray()
        self.session: Optional[Session] = None
        self.expected_ready = b""
        self.message: Optional[ReadyMessage] = None
        self.arrived = 0.0
        self.go_line = b""
        self.closed = False

    @property
    def expected(self) -> str:
        """The line rank 0 waits for on this connection."""
        return "JOIN" if self.session is None else "READY"


class RankBarrierServer:
    """Rank 0's side: greet each JOIN, accept authenticated READY lines until every worker rank arrived with the
    announced image, then send each its GO.

    Use as a context manager: `with RankBarrierServer(...) as server: result = server.serve(timeout)`.
    """

    def __init__(
        self,
        master_addr: str,
        ports: Sequence[int],
        nnodes: int,
        image_id: str,
        token: str,
        hosts: Optional[Sequence[str]] = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        logger: Optional[logging.Logger] = None,
        *,
        job_id: str,
    ):
        self._address = _check_master_addr(master_addr)
        if ipaddress.ip_address(self._address).is_unspecified:
            raise BarrierConfigError(
                f"master_addr {self._address} would listen on every interface of rank 0; "
                "give rank 0's own IP address on the nodes' network"
            )
        self._ports = list(ports)
        if not self._ports:
            raise BarrierConfigError("the barrier needs at least one candidate port")
        self._nnodes = _check_nnodes(nnodes)
        self._image_id = _check_word(image_id, "image_id")
        self._token = _check_token(token)
        self._job_id = _check_job_id(job_id)
        self._hosts = _check_hosts(hosts, self._nnodes)
        if not idle_timeout > 0:
            raise BarrierConfigError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        self._idle_timeout = float(idle_timeout)
        self._logger = logger or _LOGGER
        self._selector = selectors.DefaultSelector()
        self._listener: Optional[socket.socket] = None
        self._open: set = set()
        self._arrived: Dict[int, _Connection] = {}
        # All connections share one idle timeout, so accept order is expiry order: a deque, no heap.
        self._idle_deadlines: collections.deque = collections.deque()
        self._abort_reason: Optional[str] = None
        # accept() out of descriptors: the listener leaves the selector until _accept_resume_at (a readable listener
        # that cannot be accepted would wake select at once, forever), the pause doubling while it keeps failing.
        self._accept_resume_at: Optional[float] = None
        self._accept_pause = ACCEPT_PAUSE_FIRST
        self._accept_failures = 0
        self._accept_error = ""
        self.port: Optional[int] = None
        self.rejections: List[dict] = []

    def __enter__(self) -> RankBarrierServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def expected_workers(self) -> int:
        """How many workers (ranks 1..nnodes-1) must arrive before GO."""
        return self._nnodes - 1

    @property
    def arrived_ranks(self) -> List[int]:
        """The worker ranks whose READY was accepted so far, in rank order."""
        return sorted(self._arrived)

    def listen(self) -> int:
        """Bind master_addr on the first free candidate port and listen; the port."""
        if self._listener is not None:
            return self.port
        raise_open_files_limit(self.expected_workers + SPARE_DESCRIPTORS, self._logger)
        family = socket.AF_INET6 if ipaddress.ip_address(self._address).version == 6 else socket.AF_INET
        taken = []
        for port in self._ports:
            sock = socket.socket(family, socket.SOCK_STREAM)
            # A previous barrier's connections in TIME_WAIT must not block this port; a live listener still does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self._address, port))
            except OSError as error:
                sock.close()
                if error.errno == errno.EADDRINUSE:
                    taken.append(port)
                    continue
                if error.errno == errno.EADDRNOTAVAIL:
                    raise BarrierConfigError(
                        f"master_addr {self._address} is not an address of this host, so rank 0 cannot listen "
                        "on it: rank 0 must run on the node that owns master_addr (check MASTER_ADDR)"
                    ) from None
                raise BarrierError(f"rank 0 cannot listen on {self._address} port {port}: {error.strerror}") from None
            # A short line must leave at once, not wait for the peer's delayed ACK of the one before (Nagle).
            # Accepted sockets inherit the option from the listener: one system call instead of one per worker.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, None)
            self._listener, self.port = sock, sock.getsockname()[1]
            self._logger.info("rank barrier: rank 0 listening on %s port %d", self._address, self.port)
            return self.port
        raise BarrierError(
            f"every barrier port candidate on {self._address} is in use ({', '.join(map(str, taken))}): "
            "another job's barrier or service holds them; use another port_range or more port_candidates"
        )

    def serve(
        self, timeout: float = DEFAULT_TIMEOUT, abort_check: Optional[Callable[[], Optional[str]]] = None
    ) -> BarrierResult:
        """Wait until every worker rank arrived with the announced image, send GO to all; the released barrier.

        Raises BarrierAborted when a worker has another image or `abort_check()` (asked every
        ABORT_CHECK_INTERVAL seconds) says why the run was given up elsewhere - in pull mode a worker that failed
        before the barrier leaves the job's ABORT marker, and no controller stops rank 0 for it -, BarrierTimeout
        when `timeout` seconds pass; either way every connected worker gets ABORT with the reason first. After GO
        the connections stay open until close(): a released worker closes its end first, so rank 0 spends no
        time on closes while the workers wake up, and the TIME_WAIT states stay on the workers' side.
        """
        if not timeout > 0:
            raise BarrierConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        started = time.monotonic()
        if self.expected_workers == 0:
            return BarrierResult(port=None, waited_seconds=0.0)
        self.listen()
        deadline = started + timeout
        next_check = started
        while True:
            # Before counting arrivals: the last worker to arrive may be the one with another image.
            if self._abort_reason is not None:
                self._abort_everyone(self._abort_reason)
                raise BarrierAborted(
                    f"rank 0 aborted the barrier: {self._abort_reason}", self._abort_reason, self.rejections
                )
            if len(self._arrived) == self.expected_workers:
                break
            now = time.monotonic()
            if now >= deadline:
                self._give_up(timeout)
            if abort_check is not None and now >= next_check:
                given_up = abort_check()
                if given_up:
                    self._abort_reason = given_up
                    continue
                next_check = now + ABORT_CHECK_INTERVAL
            self._drop_idle(now)
            if self._accept_resume_at is not None and now >= self._accept_resume_at:
                self._accept_resume_at = None
                self._selector.register(self._listener, selectors.EVENT_READ, None)
            wait = (
                min(
                    deadline,
                    self._next_idle_deadline(),
                    next_check if abort_check else deadline,
                    self._accept_resume_at or deadline,
                )
                - now
            )
            for key, _ in self._selector.select(max(wait, 0.0)):
                if key.data is None:
                    self._accept_pending()
                else:
                    self._receive(key.data)
        # Each GO line was made when its JOIN was greeted: the release is sends only.
        for conn in self._arrived.values():
            self._send(conn, conn.go_line)
        return BarrierResult(
            port=self.port,
            waited_seconds=round(time.monotonic() - started, 3),
            workers=[
                {
                    "rank": rank,
                    "hostname": conn.message.hostname,
                    "peer": conn.peer,
                    "arrived_seconds": round(conn.arrived - started, 4),
                }
                for rank, conn in sorted(self._arrived.items())
            ],
            rejections=list(self.rejections),
            warnings=self._warnings(),
        )

    def _warnings(self) -> List[str]:
        if not self._accept_failures:
            return []
        return [
            f"rank 0 could not accept a connection {self._accept_failures} time(s) ({self._accept_error}), which held "
            "the workers back: raise its open-files limit (ulimit -n, or LimitNOFILE for slurmd)"
        ]

    def close(self) -> None:
        """Close every connection and the listener (idempotent)."""
        for conn in list(self._open):
            self._close(conn)
        if self._listener is not None:
            if self._accept_resume_at is None:
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        self._selector.close()

    # -- events

    def _accept_pending(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                # Out of descriptors: the backlog keeps the connection until some close. Pause, log it once.
                if not self._accept_failures:
                    self._logger.error("rank barrier: cannot accept connections: %s", error)
                self._accept_failures += 1
                self._accept_error = error.strerror or str(error)
                self._selector.unregister(self._listener)
                self._accept_resume_at = time.monotonic() + self._accept_pause
                self._accept_pause = min(2 * self._accept_pause, ACCEPT_PAUSE_MAX)
                return
            self._accept_pause = ACCEPT_PAUSE_FIRST
            sock.setblocking(False)
            conn = _Connection(sock, _format_peer(address))
            self._open.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._idle_deadlines.append((time.monotonic() + self._idle_timeout, conn))

    def _receive(self, conn: _Connection) -> None:
        if conn.closed:
            return  # closed earlier in the same batch of events (replaced, rejected)
        try:
            chunk = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if conn.message is not None:
            if not chunk:
                self._forget(conn)
            return  # nothing is expected after READY; whatever comes is ignored
        if not chunk:
            self._reject(
                conn,
                f"closed mid-line: half-sent {conn.expected}"
                if conn.buffer
                else f"closed without sending {conn.expected}",
            )
            return
        conn.buffer += chunk
        while conn.message is None and not conn.closed:
            end = conn.buffer.find(b"\n")
            if end < 0:
                if len(conn.buffer) >= MAX_LINE_BYTES:
                    self._reject(conn, f"oversized line: no newline within {MAX_LINE_BYTES} bytes")
                return
            if end >= MAX_LINE_BYTES:
                self._reject(conn, f"oversized line: longer than {MAX_LINE_BYTES} bytes")
                return
            line = bytes(conn.buffer[:end])
            del conn.buffer[: end + 1]
            try:
                if conn.session is None:
                    self._greet(conn, line)
                elif hmac.compare_digest(line, conn.expected_ready):
                    self._admit(conn, ReadyMessage(conn.session.rank, conn.session.hostname, self._image_id))
                else:  # another image, or not authentic: say which
                    self._admit(conn, parse_ready_line(line, self._token, conn.session))
            except ProtocolViolation as violation:
                self._reject(conn, violation.reason)

    def _greet(self, conn: _Connection, line: bytes) -> None:
        """Answer a JOIN with HELLO: rank 0's nonce and its proof of the token over the worker's nonce."""
        rank, hostname, worker_nonce = parse_join_line(line, self._nnodes)
        conn.session = Session(self._job_id, rank, hostname, new_nonce(), worker_nonce)
        self._send(conn, format_hello_line(self._token, conn.session))
        # Made now, outside the barrier's window: checking an honest READY is then one comparison, and GO a send.
        conn.expected_ready = format_ready_line(self._token, conn.session, self._image_id)[:-1]
        conn.go_line = format_go_line(self._token, conn.session, self._image_id)

    def _admit(self, conn: _Connection, message: ReadyMessage) -> None:
        holder = self._arrived.get(message.rank)
        if holder is not None:
            if holder.message.hostname != message.hostname:
                self._reject(
                    conn,
                    f"duplicate rank {message.rank}: already joined from {holder.message.hostname} "
                    f"({holder.peer}), this READY claims {message.hostname}",
                )
                return
            # The same node again: its first connection broke on its side before we noticed.
            self._logger.info(
                "rank barrier: rank %d (%s) reconnected from %s; dropping its connection from %s",
                message.rank,
                message.hostname,
                conn.peer,
                holder.peer,
            )
            self._close(holder)
        conn.message = message
        conn.arrived = time.monotonic()
        self._arrived[message.rank] = conn
        if message.image_id != self._image_id:
            self._abort_reason = (
                f"node {message.hostname} (rank {message.rank}) has image {message.image_id}, "
                f"but rank 0 announced {self._image_id}"
            )

    def _forget(self, conn: _Connection) -> None:
        message = conn.message
        if self._arrived.get(message.rank) is conn:
            del self._arrived[message.rank]
            self._logger.info(
                "rank barrier: rank %d (%s) disconnected from %s before GO; waiting for it to reconnect",
                message.rank,
                message.hostname,
                conn.peer,
            )
        self._close(conn)

    def _drop_idle(self, now: float) -> None:
        while self._idle_deadlines and self._idle_deadlines[0][0] <= now:
            _, conn = self._idle_deadlines.popleft()
            if not conn.closed and conn.message is None:
                self._reject(conn, f"idle: no complete {conn.expected} line within {self._idle_timeout:g} s")

    def _next_idle_deadline(self) -> float:
        while self._idle_deadlines:
            expires, conn = self._idle_deadlines[0]
            if not conn.closed and conn.message is None:
                return expires
            self._idle_deadlines.popleft()
        return float("inf")

    # -- outcomes

    def _reject(self, conn: _Connection, reason: str) -> None:
        self._logger.warning("rank barrier: rejected %s: %s", conn.peer, reason)
        if len(self.rejections) < MAX_REPORTED_REJECTIONS:
            self.rejections.append({"peer": conn.peer, "reason": reason})
        self._close(conn)

    def _abort_everyone(self, reason: str) -> None:
        conns = list(self._open)
        # Every worker first, closing after: the last worker's ABORT must not wait for the others' closes.
        # A connection that was not greeted yet has no session to authenticate an ABORT with: it is only closed.
        for conn in conns:
            if conn.session is not None:
                self._send(conn, format_abort_line(self._token, conn.session, reason))
        for conn in conns:
            self._close(conn)

    def _give_up(self, timeout: float) -> None:
        missing = [(rank, self._host_of(rank)) for rank in range(1, self._nnodes) if rank not in self._arrived]
        names = ", ".join(f"{rank} ({host})" if host else str(rank) for rank, host in missing)
        reason = f"rank 0 gave up after {timeout:g} s: missing ranks {names}"
        self._abort_everyone(reason)
        rejected = f"; {len(self.rejections)} connection(s) rejected, see 'rejected'" if self.rejections else ""
        raise BarrierTimeout(
            f"{reason}. Those nodes never reported their image to rank 0 at {self._address} port {self.port}: "
            f"check their image load step and that they reach {self._address}{rejected}",
            missing,
            self.rejections,
        )

    def _host_of(self, rank: int) -> Optional[str]:
        return self._hosts[rank] if self._hosts else None

    def _send(self, conn: _Connection, line: bytes) -> None:
        # A short line always fits an idle socket's send buffer; one that does not is a connection gone bad.
        try:
            sent = conn.sock.send(line)
        except OSError:
            sent = -1
        if sent != len(line):
            self._logger.info("rank barrier: could not send %s to %s", line.split(b" ")[0].strip().decode(), conn.peer)

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._open.discard(conn)
        self._selector.unregister(conn.sock)
        conn.sock.close()


def _check_hosts(hosts, nnodes: int) -> Optional[List[str]]:
    if hosts is None:
        return None
    hosts = list(hosts)
    if len(hosts) != nnodes or not all(isinstance(host, str) and host for host in hosts):
        raise BarrierConfigError(
            f"hosts must name every node in rank order ({nnodes} names for nnodes={nnodes}), got {len(hosts)}"
        )
    return hosts


# --------------------------------------------------------------------------------------------------------- workers


class _AttemptFailed(Exception):
    """One connection to one candidate port did not end in GO; worth retrying.

    `greeted`: this run's rank 0 greeted us on that port, so it is the one to try first from then on.
    `refused`: the listener answered something this worker refuses (a greeting, GO or ABORT that failed
    authentication, garbage): reported, because it may be an impostor on that port.
    """

    def __init__(self, why: str, greeted: bool = False, refused: bool = False):
        super().__init__(why)
        self.greeted = greeted
        self.refused = refused


class WorkerConnection:
    """A worker's connection to one candidate port: `open` it (connected, and greeted by a HELLO that proves the
    token), then `announce` READY and wait for an authenticated GO.

    Both raise _AttemptFailed when this port did not work out (worth another try); `announce` raises
    BarrierAborted on an authenticated ABORT, BarrierError on a GO for another image. Lines are read from a
    blocking socket with a kernel receive timeout (SO_RCVTIMEO): a wake-up is then one recv() call and one turn
    at the GIL, where Python's own socket timeout polls first and takes two. Negligible for one worker per node;
    it halved the release latency of the benchmark's thousand simulated workers on two cores. For the same
    reason the READY line and the GO line expected back are made right after the greeting, so that the wake-up
    on GO is one comparison.
    """

    def __init__(self, sock: socket.socket, token: str, message: ReadyMessage):
        self._sock = sock
        self._buffer = bytearray()
        self._token = token
        self._message = message
        self.session: Optional[Session] = None
        self._ready_line = b""
        self._expected_go = b""

    @classmethod
    def open(
        cls,
        address: str,
        port: int,
        deadline: float,
        token: str,
        job_id: str,
        message: ReadyMessage,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    ) -> WorkerConnection:
        """Connect (within `connect_timeout`), send JOIN and check rank 0's HELLO (within `reply_timeout`)."""
        try:
            sock = socket.create_connection(
                (address, port), timeout=max(0.001, min(connect_timeout, deadline - time.monotonic()))
            )
        except socket.timeout:
            raise _AttemptFailed("connect timed out") from None
        except OSError as error:
            raise _AttemptFailed(error.strerror or str(error)) from None
        sock.settimeout(None)
        connection = cls(sock, token, message)
        try:
            connection._greet(job_id, min(deadline, time.monotonic() + reply_timeout))
        except BaseException:
            connection.close()
            raise
        return connection

    def _greet(self, job_id: str, until: float) -> None:
        worker_nonce = new_nonce()
        try:
            self._sock.sendall(format_join_line(self._message.rank, self._message.hostname, worker_nonce))
            greeting = self._read_line(until)
        except socket.timeout:
            raise _AttemptFailed("no HELLO within the reply timeout (not a rank barrier?)") from None
        except OSError as error:
            raise _AttemptFailed(f"connection lost: {error.strerror or error}") from None
        if greeting is None:
            raise _AttemptFailed("closed without HELLO (rank 0 out of descriptors, or not a rank barrier)")
        try:
            self.session = parse_hello_line(
                greeting, self._token, job_id, self._message.rank, self._message.hostname, worker_nonce
            )
        except ProtocolViolation as violation:
            raise _AttemptFailed(f"greeting refused: {violation.reason}", refused=True) from None
        self._ready_line = format_ready_line(self._token, self.session, self._message.image_id)
        self._expected_go = format_go_line(self._token, self.session, self._message.image_id)[:-1]

    def announce(self, deadline: float) -> None:
        """Send READY and wait until `deadline` for rank 0's authenticated GO for this node's image."""
        try:
            self._sock.sendall(self._ready_line)
            reply = self._read_line(deadline)
        except socket.timeout:
            raise _AttemptFailed("no GO before the deadline", greeted=True) from None
        except OSError as error:
            raise _AttemptFailed(f"connection lost: {error.strerror or error}", greeted=True) from None
        if reply is not None and hmac.compare_digest(reply, self._expected_go):
            return
        if reply is None:
            raise _AttemptFailed(
                "rank 0 closed the connection after READY (rejected it? rank 0 logs why)", greeted=True
            )
        try:
            release = parse_release_line(reply, self._token, self.session)
        except ProtocolViolation as violation:
            raise _AttemptFailed(f"{violation.reason}; ignored", refused=True) from None
        if not release.go:
            raise BarrierAborted(f"rank 0 aborted the barrier: {release.reason}", release.reason)
        raise BarrierError(
            f"rank 0 released the barrier for image {release.image_id}, but rank {self._message.rank} holds "
            f"{self._message.image_id}: this node would run another image than rank 0. Check the image step on "
            "this node, and that every node was given rank 0's image ID"
        )

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> WorkerConnection:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _read_line(self, until: float) -> Optional[bytes]:
        """The next line without its newline, None at end of stream; socket.timeout once `until` passes.

        Tolerates partial reads and keeps what follows a newline.
        """
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) >= MAX_LINE_BYTES:
                raise _AttemptFailed(f"a reply longer than {MAX_LINE_BYTES} bytes (not a rank barrier?)", refused=True)
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise socket.timeout()
            seconds, fraction = divmod(remaining, 1.0)
            timeval = struct.pack("ll", int(seconds), max(1, int(fraction * 1e6)))  # never 0: that means "none"
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            try:
                chunk = self._sock.recv(MAX_LINE_BYTES)
            except BlockingIOError:  # the receive timeout passed
                continue
            if not chunk:
                return None
            self._buffer += chunk


def _attempt_join(
    address: str,
    port: int,
    token: str,
    job_id: str,
    message: ReadyMessage,
    deadline: float,
    connect_timeout: float,
    reply_timeout: float,
) -> None:
    """Connect to one candidate port, JOIN, check HELLO, send READY, wait for GO; raise _AttemptFailed,
    BarrierAborted or BarrierError."""
    with WorkerConnection.open(
        address, port, deadline, token, job_id, message, connect_timeout, reply_timeout
    ) as connection:
        connection.announce(deadline)


def join_rank_barrier(
    master_addr: str,
    ports: Sequence[int],
    rank: int,
    nnodes: int,
    token: str,
    image_id: str,
    timeout: float = DEFAULT_TIMEOUT,
    hostname: Optional[str] = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    abort_check: Optional[Callable[[], Optional[str]]] = None,
    logger: Optional[logging.Logger] = None,
    *,
    job_id: str,
) -> BarrierResult:
    """A worker's side: announce READY to rank 0 and block until its authenticated GO; the released barrier.

    Tries each candidate port in turn, and keeps trying until `timeout` seconds pass: rank 0 may not listen
    yet, a dropped connection is reconnected and READY sent again, and a listener that cannot prove the token
    (another service, another job's barrier, an impostor) is passed over for the next port. Before each attempt
    `abort_check()`, when given, may return why the run was given up elsewhere (rank 0 could not open the
    barrier at all), and the worker stops at once instead of at its deadline. Raises BarrierAborted with rank
    0's reason on its ABORT, BarrierError when rank 0's GO is for another image than `image_id`, BarrierTimeout
    (naming what each port answered last) at the deadline.
    """
    address = _check_master_addr(master_addr)
    nnodes = _check_nnodes(nnodes)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < nnodes:
        raise BarrierConfigError(f"a worker's rank must be an integer from 1 to nnodes-1={nnodes - 1}, got {rank!r}")
    if not timeout > 0 or not connect_timeout > 0 or not reply_timeout > 0:
        raise BarrierConfigError("timeout, connect_timeout and reply_timeout must be positive numbers of seconds")
    _check_token(token)
    _check_job_id(job_id)
    message = ReadyMessage(
        rank, _check_word(hostname or socket.gethostname(), "hostname"), _check_word(image_id, "image_id")
    )
    candidates = list(ports)
    if not candidates:
        raise BarrierConfigError("the barrier needs at least one candidate port")
    logger = logger or _LOGGER
    started = time.monotonic()
    deadline = started + timeout
    last_failure: Dict[int, str] = {}
    refused: List[dict] = []
    pause = MIN_RETRY_PAUSE
    while True:
        for port in list(candidates):
            given_up = abort_check() if abort_check else None
            if given_up:
                raise BarrierAborted(
                    f"the run was given up while rank {rank} waited at the barrier: {given_up}", given_up, refused
                )
            if time.monotonic() >= deadline:
                tried = "; ".join(f"port {p}: {why}" for p, why in last_failure.items()) or "no attempt finished"
                raise BarrierTimeout(
                    f"rank {rank} got no GO from rank 0 at {address} within {timeout:g} s ({tried}). "
                    "Is rank 0 at the barrier, and does this node reach master_addr?",
                    rejections=refused,
                )
            try:
                _attempt_join(address, port, token, job_id, message, deadline, connect_timeout, reply_timeout)
            except _AttemptFailed as failure:
                last_failure[port] = str(failure)
                if failure.refused:
                    peer = _format_peer((address, port))
                    logger.warning("rank barrier: rank %d refused %s: %s", rank, peer, failure)
                    if len(refused) < MAX_REPORTED_REJECTIONS:
                        refused.append({"peer": peer, "reason": str(failure)})
                if failure.greeted:
                    candidates.remove(port)
                    candidates.insert(0, port)
                continue
            except BarrierError as error:
                error.rejections = refused
                raise
            return BarrierResult(port=port, waited_seconds=round(time.monotonic() - started, 3), rejections=refused)
        # Rank 0 may not listen yet, or just rejected us: back off, but never past the deadline.
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 2, MAX_RETRY_PAUSE)


def wait_at_barrier(
    rank: int,
    nnodes: int,
    master_addr: str,
    ports: Sequence[int],
    token: str,
    image_id: str,
    timeout: float = DEFAULT_TIMEOUT,
    hosts: Optional[Sequence[str]] = None,
    hostname: Optional[str] = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    logger: Optional[logging.Logger] = None,
    abort_check: Optional[Callable[[], Optional[str]]] = None,
    *,
    job_id: str,
) -> BarrierResult:
    """One node's part of the barrier, by rank: rank 0 serves (with `image_id` as the announced image), others join.

    The one entry point for the Ansible module and the pull mode. `job_id` is covered by every message's MAC, so
    a token reused across jobs never lets one job's messages count in another's. `abort_check` says why the run
    was given up elsewhere (RankBarrierServer.serve, join_rank_barrier).
    """
    if rank == 0:
        with RankBarrierServer(
            master_addr, ports, nnodes, image_id, token, hosts, idle_timeout, logger, job_id=job_id
        ) as server:
            return server.serve(timeout, abort_check)
    return join_rank_barrier(
        master_addr,
        ports,
        rank,
        nnodes,
        token,
        image_id,
        timeout,
        hostname,
        connect_timeout,
        abort_check=abort_check,
        logger=logger,
        job_id=job_id,
    )
