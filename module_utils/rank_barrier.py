"""The rank-0 image-ready barrier: no node leaves the build stage before every node holds the image rank 0 announced.

Rank 0 serves, every other rank joins. Standard library only and independent of Ansible, so that the
`rank_barrier` module and the planned pull mode (one `ansible-playbook -c local` per node, no task boundary
between nodes) share this code.

Protocol: one ASCII line per message, at most MAX_LINE_BYTES including the newline.

    rank 0 -> worker   HELLO              on accept: a rank barrier listens on this port
    worker -> rank 0   READY <token> <rank> <hostname> <image-id>
    rank 0 -> worker   GO                 every rank arrived with the image rank 0 announced
    rank 0 -> worker   ABORT <reason>     a node has another image, or rank 0 gave up

HELLO exists because barrier ports are derived from the job and can collide with another service's on a shared
node: a worker sends its token only after the greeting, so a silent or foreign listener on one candidate port
costs it a reply timeout (and learns no token), not the whole deadline. A rejected connection is closed without
a reply: an unauthenticated peer learns nothing, and rank 0 reports the reason with the peer's address.

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
# How long a worker waits for rank 0's HELLO before trying the next candidate port.
DEFAULT_REPLY_TIMEOUT = 5.0
# A worker's pause between rounds over the candidate ports, doubling while rank 0 does not listen yet.
MIN_RETRY_PAUSE = 0.05
MAX_RETRY_PAUSE = 1.0
MAX_LINE_BYTES = 512
HELLO = b"HELLO\n"
GO = b"GO\n"
# Rank 0 logs every rejection but keeps only this many for its result, so a flood cannot exhaust its memory.
MAX_REPORTED_REJECTIONS = 256
# The kernel caps this at net.core.somaxconn; it must hold every worker connecting at once.
LISTEN_BACKLOG = 4096
# Descriptors rank 0 needs beyond one per worker: listener, selector, stray connections, the interpreter's own.
SPARE_DESCRIPTORS = 128

_WORD = re.compile(r"[!-~]{1,255}\Z")  # printable ASCII without spaces: token, hostname, image ID
_RANK = re.compile(r"(0|[1-9][0-9]{0,8})\Z")  # no sign, no padding, no underscores: int() accepts all three

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
    """A line that is not an acceptable READY; `reason` never quotes the line (it may hold a token)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ReadyMessage:
    """What a worker announces: its rank, its hostname and the ID of the image it holds."""

    rank: int
    hostname: str
    image_id: str


@dataclass
class BarrierResult:
    """A released barrier. `workers` and `rejections` are filled on rank 0 only."""

    port: Optional[int]
    waited_seconds: float
    workers: List[dict] = field(default_factory=list)
    rejections: List[dict] = field(default_factory=list)


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
    digest = hashlib.sha256(f"{master_port}/{job_id}".encode("utf-8")).digest()
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
            "raise `ulimit -Hn` on the node", target, needed,
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


def _check_nnodes(nnodes) -> int:
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise BarrierConfigError(f"nnodes must be a positive integer, got {nnodes!r}")
    return nnodes


def format_ready_line(token: str, rank: int, hostname: str, image_id: str) -> bytes:
    """The READY line a worker sends, newline included; refuses values the protocol cannot carry."""
    _check_token(token)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise BarrierConfigError(f"a worker's rank must be a positive integer, got {rank!r}")
    line = "READY {} {} {} {}\n".format(
        token, rank, _check_word(hostname, "hostname"), _check_word(image_id, "image_id")
    ).encode("ascii")
    if len(line) > MAX_LINE_BYTES:
        raise BarrierConfigError(
            f"the READY line would be {len(line)} bytes, over the protocol's {MAX_LINE_BYTES}: "
            "use a shorter token, hostname or image ID"
        )
    return line


def parse_ready_line(line: bytes, token: str, nnodes: int) -> ReadyMessage:
    """Check one READY line (newline stripped) from a worker; raise ProtocolViolation saying what is wrong.

    The token is checked before anything a peer could learn from, in constant time.
    """
    try:
        fields = line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise ProtocolViolation("garbage: not an ASCII line") from None
    if fields[0] != "READY":
        raise ProtocolViolation("garbage: not a READY line")
    if len(fields) != 5:
        raise ProtocolViolation(f"malformed READY: {len(fields)} space-separated fields instead of 5")
    _, offered_token, rank_text, hostname, image_id = fields
    if not hmac.compare_digest(offered_token.encode("ascii"), token.encode("ascii")):
        raise ProtocolViolation("wrong token")
    if not _RANK.match(rank_text):
        raise ProtocolViolation("rank is not a plain decimal integer")
    rank = int(rank_text)
    if not 0 < rank < nnodes:
        raise ProtocolViolation(f"rank {rank} out of range: workers are ranks 1..{nnodes - 1}")
    if not _WORD.match(hostname) or not _WORD.match(image_id):
        raise ProtocolViolation(f"rank {rank}: empty or non-printable hostname or image ID")
    return ReadyMessage(rank, hostname, image_id)


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
    """One accepted socket; `message` and `arrived` (monotonic time) are set once its READY was accepted."""

    __slots__ = ("sock", "peer", "buffer", "message", "arrived", "closed")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.buffer = bytearray()
        self.message: Optional[ReadyMessage] = None
        self.arrived = 0.0
        self.closed = False


class RankBarrierServer:
    """Rank 0's side: accept READY lines until every worker rank arrived with the announced image, then GO.

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
        self._accept_failing = False
        self.port: Optional[int] = None
        self.rejections: List[dict] = []

    def __enter__(self) -> "RankBarrierServer":
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

    def serve(self, timeout: float = DEFAULT_TIMEOUT) -> BarrierResult:
        """Wait until every worker rank arrived with the announced image, send GO to all; the released barrier.

        Raises BarrierAborted when a worker has another image, BarrierTimeout when `timeout` seconds pass;
        either way every connected worker gets ABORT with the reason first. After GO the connections stay open
        until close(): a released worker closes its end first, so rank 0 spends no time on closes while the
        workers wake up, and the TIME_WAIT states stay on the workers' side.
        """
        if not timeout > 0:
            raise BarrierConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        started = time.monotonic()
        if self.expected_workers == 0:
            return BarrierResult(port=None, waited_seconds=0.0)
        self.listen()
        deadline = started + timeout
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
            self._drop_idle(now)
            wait = min(deadline, self._next_idle_deadline()) - now
            for key, _ in self._selector.select(max(wait, 0.0)):
                if key.data is None:
                    self._accept_pending()
                else:
                    self._receive(key.data)
        for conn in self._arrived.values():
            self._send(conn, GO)
        return BarrierResult(
            port=self.port,
            waited_seconds=round(time.monotonic() - started, 3),
            workers=[
                {"rank": rank, "hostname": conn.message.hostname, "peer": conn.peer,
                 "arrived_seconds": round(conn.arrived - started, 4)}
                for rank, conn in sorted(self._arrived.items())
            ],
            rejections=list(self.rejections),
        )

    def close(self) -> None:
        """Close every connection and the listener (idempotent)."""
        for conn in list(self._open):
            self._close(conn)
        if self._listener is not None:
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
                # Out of descriptors: the backlog keeps the connection until some close; log it once.
                if not self._accept_failing:
                    self._logger.error("rank barrier: cannot accept connections: %s", error)
                self._accept_failing = True
                return
            self._accept_failing = False
            sock.setblocking(False)
            conn = _Connection(sock, _format_peer(address))
            self._open.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._idle_deadlines.append((time.monotonic() + self._idle_timeout, conn))
            self._send(conn, HELLO)

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
            self._reject(conn, "closed mid-line: half-sent READY" if conn.buffer else "closed without sending READY")
            return
        conn.buffer += chunk
        end = conn.buffer.find(b"\n")
        if end < 0:
            if len(conn.buffer) >= MAX_LINE_BYTES:
                self._reject(conn, f"oversized line: no newline within {MAX_LINE_BYTES} bytes")
            return
        if end >= MAX_LINE_BYTES:
            self._reject(conn, f"oversized line: longer than {MAX_LINE_BYTES} bytes")
            return
        line = bytes(conn.buffer[:end])
        del conn.buffer[:]
        try:
            message = parse_ready_line(line, self._token, self._nnodes)
        except ProtocolViolation as violation:
            self._reject(conn, violation.reason)
            return
        self._admit(conn, message)

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
                message.rank, message.hostname, conn.peer, holder.peer,
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
                message.rank, message.hostname, conn.peer,
            )
        self._close(conn)

    def _drop_idle(self, now: float) -> None:
        while self._idle_deadlines and self._idle_deadlines[0][0] <= now:
            _, conn = self._idle_deadlines.popleft()
            if not conn.closed and conn.message is None:
                self._reject(conn, f"idle: no complete READY line within {self._idle_timeout:g} s")

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
        line = f"ABORT {reason}".encode("ascii", "replace")[: MAX_LINE_BYTES - 1] + b"\n"
        conns = list(self._open)
        # Every worker first, closing after: the last worker's ABORT must not wait for the others' closes.
        for conn in conns:
            self._send(conn, line)
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

    `greeted`: a rank barrier answered HELLO on that port, so it is the one to try first from then on.
    """

    def __init__(self, why: str, greeted: bool = False):
        super().__init__(why)
        self.greeted = greeted


class WorkerConnection:
    """A worker's connection to one candidate port: `open` it (connected and greeted), then `announce` READY.

    Both raise _AttemptFailed when this port did not work out (worth another try) and `announce` raises
    BarrierAborted on ABORT. Lines are read from a blocking socket with a kernel receive timeout (SO_RCVTIMEO):
    a wake-up is then one recv() call and one turn at the GIL, where Python's own socket timeout polls first and
    takes two. Negligible for one worker per node; it halved the release latency of the benchmark's thousand
    simulated workers on two cores.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buffer = bytearray()

    @classmethod
    def open(cls, address: str, port: int, deadline: float, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
             reply_timeout: float = DEFAULT_REPLY_TIMEOUT) -> "WorkerConnection":
        """Connect (within `connect_timeout`) and wait for rank 0's HELLO (within `reply_timeout`)."""
        try:
            sock = socket.create_connection(
                (address, port), timeout=max(0.001, min(connect_timeout, deadline - time.monotonic()))
            )
        except socket.timeout:
            raise _AttemptFailed("connect timed out") from None
        except OSError as error:
            raise _AttemptFailed(error.strerror or str(error)) from None
        sock.settimeout(None)
        connection = cls(sock)
        try:
            connection._expect_hello(min(deadline, time.monotonic() + reply_timeout))
        except BaseException:
            connection.close()
            raise
        return connection

    def _expect_hello(self, until: float) -> None:
        try:
            greeting = self._read_line(until)
        except socket.timeout:
            raise _AttemptFailed("no HELLO within the reply timeout (not a rank barrier?)") from None
        except OSError as error:
            raise _AttemptFailed(f"connection lost: {error.strerror or error}") from None
        if greeting is None:
            raise _AttemptFailed("closed without HELLO (rank 0 out of descriptors, or not a rank barrier)")
        if greeting != HELLO[:-1]:
            raise _AttemptFailed("no HELLO: another service holds this port")

    def announce(self, ready_line: bytes, deadline: float) -> None:
        """Send READY and wait for GO until `deadline`."""
        try:
            self._sock.sendall(ready_line)
            reply = self._read_line(deadline)
        except socket.timeout:
            raise _AttemptFailed("no GO before the deadline", greeted=True) from None
        except OSError as error:
            raise _AttemptFailed(f"connection lost: {error.strerror or error}", greeted=True) from None
        if reply == GO[:-1]:
            return
        if reply is None:
            raise _AttemptFailed("rank 0 closed the connection after READY (rejected it? rank 0 logs why)",
                                 greeted=True)
        if reply.startswith(b"ABORT "):
            reason = reply[len(b"ABORT "):].decode("ascii", "replace")
            raise BarrierAborted(f"rank 0 aborted the barrier: {reason}", reason)
        raise _AttemptFailed("an unexpected reply after READY (not a rank barrier?)", greeted=True)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "WorkerConnection":
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
                raise _AttemptFailed(f"a reply longer than {MAX_LINE_BYTES} bytes (not a rank barrier?)")
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


def _attempt_join(address: str, port: int, ready_line: bytes, deadline: float, connect_timeout: float,
                  reply_timeout: float) -> None:
    """Connect to one candidate port, wait for HELLO, send READY, wait for GO; raise _AttemptFailed or BarrierAborted."""
    with WorkerConnection.open(address, port, deadline, connect_timeout, reply_timeout) as connection:
        connection.announce(ready_line, deadline)


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
) -> BarrierResult:
    """A worker's side: announce READY to rank 0 and block until GO; the released barrier.

    Tries each candidate port in turn, and keeps trying until `timeout` seconds pass: rank 0 may not listen
    yet, and a dropped connection is reconnected and READY sent again. Before each attempt `abort_check()`,
    when given, may return why the run was given up elsewhere (rank 0 could not open the barrier at all), and
    the worker stops at once instead of at its deadline. Raises BarrierAborted with rank 0's reason on ABORT,
    BarrierTimeout (naming what each port answered last) at the deadline.
    """
    address = _check_master_addr(master_addr)
    nnodes = _check_nnodes(nnodes)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < nnodes:
        raise BarrierConfigError(f"a worker's rank must be an integer from 1 to nnodes-1={nnodes - 1}, got {rank!r}")
    if not timeout > 0 or not connect_timeout > 0 or not reply_timeout > 0:
        raise BarrierConfigError("timeout, connect_timeout and reply_timeout must be positive numbers of seconds")
    ready_line = format_ready_line(token, rank, hostname or socket.gethostname(), image_id)
    candidates = list(ports)
    if not candidates:
        raise BarrierConfigError("the barrier needs at least one candidate port")
    started = time.monotonic()
    deadline = started + timeout
    last_failure: Dict[int, str] = {}
    pause = MIN_RETRY_PAUSE
    while True:
        for port in list(candidates):
            given_up = abort_check() if abort_check else None
            if given_up:
                raise BarrierAborted(f"the run was given up while rank {rank} waited at the barrier: {given_up}",
                                     given_up)
            if time.monotonic() >= deadline:
                tried = "; ".join(f"port {p}: {why}" for p, why in last_failure.items()) or "no attempt finished"
                raise BarrierTimeout(
                    f"rank {rank} got no GO from rank 0 at {address} within {timeout:g} s ({tried}). "
                    "Is rank 0 at the barrier, and does this node reach master_addr?"
                )
            try:
                _attempt_join(address, port, ready_line, deadline, connect_timeout, reply_timeout)
            except _AttemptFailed as failure:
                last_failure[port] = str(failure)
                if failure.greeted:
                    candidates.remove(port)
                    candidates.insert(0, port)
                continue
            return BarrierResult(port=port, waited_seconds=round(time.monotonic() - started, 3))
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
) -> BarrierResult:
    """One node's part of the barrier, by rank: rank 0 serves (with `image_id` as the announced image), others join.

    The one entry point for the Ansible module and the pull mode. `abort_check` is for workers only (see
    join_rank_barrier).
    """
    if rank == 0:
        with RankBarrierServer(master_addr, ports, nnodes, image_id, token, hosts, idle_timeout, logger) as server:
            return server.serve(timeout)
    return join_rank_barrier(
        master_addr, ports, rank, nnodes, token, image_id, timeout, hostname, connect_timeout,
        abort_check=abort_check,
    )
