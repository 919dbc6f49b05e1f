"""The rank-0 barrier's workers: connect to rank 0's candidate ports until one greets with a HELLO that proves the
token, announce READY with the image this node holds, and wait for rank 0's GO."""

from __future__ import annotations

import hmac
import logging
import socket
import struct
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
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REPLY_TIMEOUT,
    DEFAULT_TIMEOUT,
    MAX_RETRY_PAUSE,
    MIN_RETRY_PAUSE,
    BarrierResult,
    ReadyMessage,
    format_go_line,
    format_ready_line,
    parse_hello_line,
    parse_release_line,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.server import MAX_REPORTED_REJECTIONS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    MAX_LINE_BYTES,
    ProtocolViolation,
    Session,
    check_job_id,
    check_master_addr,
    check_nnodes,
    check_token,
    check_word,
    format_join_line,
    format_peer,
    new_nonce,
    take_line,
)

_LOGGER = logging.getLogger(__name__)


class _AttemptFailed(Exception):
    """One connection to one candidate port did not end in GO; worth retrying. `greeted`: this run's rank 0 is on
    that port (try it first from then on); `refused`: the answer failed authentication (reported: an impostor?)."""

    def __init__(self, why: str, greeted: bool = False, refused: bool = False):
        super().__init__(why)
        self.greeted = greeted
        self.refused = refused


class WorkerConnection:
    """A worker's connection to one candidate port: `open` it (a HELLO that proves the token), then `announce` READY and
    wait for an authenticated GO; both raise _AttemptFailed when this port did not work out. Reads use SO_RCVTIMEO, so a
    wake-up is one recv() call."""

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

    def announce(self, deadline: float, abort_check: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Send READY and wait until `deadline` for rank 0's authenticated GO for this node's image, asking
        `abort_check()` every ABORT_CHECK_INTERVAL: a rank 0 dead on a node that drops packets never closes the
        connection. BarrierAborted on an authenticated ABORT, BarrierError on a GO for another image."""
        try:
            self._sock.sendall(self._ready_line)
            while True:
                until = min(deadline, time.monotonic() + ABORT_CHECK_INTERVAL) if abort_check else deadline
                try:
                    reply = self._read_line(until)
                    break
                except socket.timeout:
                    if until >= deadline:
                        raise
                given_up = abort_check()
                if given_up:
                    raise _given_up(self._message.rank, given_up)
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
        """The next line without its newline, None at end of stream; socket.timeout once `until` passes."""
        while True:
            line = take_line(self._buffer)
            if line is not None:
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


def _given_up(rank: int, reason: str, refused=()) -> BarrierAborted:
    """The error of a worker whose `abort_check` said why the run was given up."""
    return BarrierAborted(f"the run was given up while rank {rank} waited at the barrier: {reason}", reason, refused)


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
    Tries each candidate port until `timeout`; BarrierAborted at once when `abort_check()` says why, BarrierTimeout
    names what each port answered last."""
    address = check_master_addr(master_addr)
    nnodes = check_nnodes(nnodes)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < nnodes:
        raise BarrierConfigError(f"a worker's rank must be an integer from 1 to nnodes-1={nnodes - 1}, got {rank!r}")
    if not timeout > 0 or not connect_timeout > 0 or not reply_timeout > 0:
        raise BarrierConfigError("timeout, connect_timeout and reply_timeout must be positive numbers of seconds")
    check_token(token)
    check_job_id(job_id)
    message = ReadyMessage(
        rank, check_word(hostname or socket.gethostname(), "hostname"), check_word(image_id, "image_id")
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
                raise _given_up(rank, given_up, refused)
            if time.monotonic() >= deadline:
                tried = "; ".join(f"port {p}: {why}" for p, why in last_failure.items()) or "no attempt finished"
                raise BarrierTimeout(
                    f"rank {rank} got no GO from rank 0 at {address} within {timeout:g} s ({tried}). "
                    "Is rank 0 at the barrier, and does this node reach master_addr?",
                    rejections=refused,
                )
            try:
                with WorkerConnection.open(
                    address, port, deadline, token, job_id, message, connect_timeout, reply_timeout
                ) as connection:
                    connection.announce(deadline, abort_check)
            except _AttemptFailed as failure:
                last_failure[port] = str(failure)
                if failure.refused:
                    peer = format_peer((address, port))
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
