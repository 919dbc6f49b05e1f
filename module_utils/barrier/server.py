"""The rank-0 barrier's rank 0, one thread around a selector: a slow, idle or hostile connection never delays the
honest workers, and a thousand connections cost a thousand sockets, not threads."""

from __future__ import annotations

import collections
import errno
import hmac
import ipaddress
import logging
import selectors
import socket
import time
from typing import Callable, Dict, List, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import (
    BarrierAborted,
    BarrierConfigError,
    BarrierError,
    BarrierTimeout,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import (
    ABORT_CHECK_INTERVAL,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_TIMEOUT,
    BarrierResult,
    ReadyMessage,
    format_abort_line,
    format_go_line,
    format_hello_line,
    format_ready_line,
    parse_ready_line,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    MAX_LINE_BYTES,
    ProtocolViolation,
    Session,
    check_job_id,
    check_master_addr,
    check_nnodes,
    check_token,
    check_word,
    format_peer,
    new_nonce,
    parse_join_line,
    raise_open_files_limit,
)

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

_LOGGER = logging.getLogger(__name__)


class _Connection:
    """One accepted socket: `session`, `expected_ready` and `go_line` are set once its JOIN was answered with HELLO;
    `message` and `arrived` once its READY was accepted."""

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
    """Rank 0's side, used as `with RankBarrierServer(...) as server: server.serve(timeout)`."""

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
        self._address = check_master_addr(master_addr)
        if ipaddress.ip_address(self._address).is_unspecified:
            raise BarrierConfigError(
                f"master_addr {self._address} would listen on every interface of rank 0; "
                "give rank 0's own IP address on the nodes' network"
            )
        self._ports = list(ports)
        if not self._ports:
            raise BarrierConfigError("the barrier needs at least one candidate port")
        self._nnodes = check_nnodes(nnodes)
        self._image_id = check_word(image_id, "image_id")
        self._token = check_token(token)
        self._job_id = check_job_id(job_id)
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

        BarrierAborted when a worker has another image or `abort_check()` says why the run was given up elsewhere,
        BarrierTimeout after `timeout`; every connected worker gets ABORT first. After GO the workers close first, so
        TIME_WAIT stays on their side."""
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
            wake = min(deadline, self._next_idle_deadline(), self._accept_resume_at or deadline)
            if abort_check:
                wake = min(wake, next_check)
            for key, _ in self._selector.select(max(wake - now, 0.0)):
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
            conn = _Connection(sock, format_peer(address))
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
            closed = "closed mid-line: half-sent" if conn.buffer else "closed without sending"
            self._reject(conn, f"{closed} {conn.expected}")
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
        hosts = self._hosts or [None] * self._nnodes
        missing = [(rank, hosts[rank]) for rank in range(1, self._nnodes) if rank not in self._arrived]
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
