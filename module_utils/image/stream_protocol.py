"""The image stream's hops: the tree of nodes, the handshake lines, the frames and the sockets that carry them.

module_utils/image/stream.py describes the transport and its protocol, and sends and receives an image over
these hops. Standard library only (py38).
"""

from __future__ import annotations

import hmac
import re
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import is_loopback
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.wire import (
    DEFAULT_PORT_CANDIDATES,
    DEFAULT_PORT_RANGE,
    MAX_LINE_BYTES,
    ProtocolViolation,
    Session,
    derive_barrier_ports,
    format_join_line,
    message_mac,
    new_nonce,
    parse_join_line,
    take_line,
)

FRAME_HEADER = struct.Struct(">cI")
MAX_DATA_BYTES = CHUNK_BYTES
MAX_CONTROL_BYTES = 1024
DEFAULT_FANOUT = 1
DEFAULT_SETUP_TIMEOUT = 120.0
DEFAULT_IO_TIMEOUT = 120.0
CONNECT_TIMEOUT = 2.0
RETRY_PAUSE = 0.1
DATA, END, ABORT, SKIP = b"D", b"E", b"A", b"S"
# Connections that have not sent an authentic JOIN yet (a stray, a port scan, someone without the token) wait in
# one bounded pool, read by the admitting thread alone: at most this many at once, the oldest closed for each new
# one, each for JOIN_WAIT seconds (an honest child sends its JOIN the moment it is connected). So idle connections
# take no child's place, no thread and few file descriptors.
MAX_UNJOINED_CONNECTIONS = 64
JOIN_WAIT = 3.0
# Authenticated greetings at once, per child a node waits for: the real child, and its retries.
MAX_GREETINGS_PER_CHILD = 4

_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,18})\Z")
_MAC = re.compile(r"[0-9a-f]{64}\Z")


class StreamError(UserError):
    """The stream cannot be set up (configuration) or failed on this node."""


class StreamBroken(Exception):
    """The stream ended without a valid trailer: the sender or a hop died, a byte was wrong, or a timeout passed."""


# ----------------------------------------------------------------------------------------------------------- tree


def parent_rank(rank: int, fanout: int) -> int:
    """The rank a worker receives the stream from."""
    return (rank - 1) // fanout


def child_ranks(rank: int, nnodes: int, fanout: int) -> List[int]:
    """The ranks a node forwards the stream to."""
    first = rank * fanout + 1
    return list(range(first, min(first + fanout, nnodes)))


def derive_stream_ports(master_port: int, job_id, port_range=DEFAULT_PORT_RANGE, count=DEFAULT_PORT_CANDIDATES):
    """Every node's candidate ports for its listener: the barrier's derivation under another name, so the two
    never pick the same list for a job."""
    return derive_barrier_ports(master_port, f"{job_id}/image-stream", port_range, count)


def node_address(hostname: str) -> str:
    """The IPv4 address `hostname` is reached at: a non-loopback one when it has any, else a loopback one other
    than the Debian `127.0.1.1 hostname` trap (a lab whose nodes are loopback addresses)."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise StreamError(
            f"node {hostname} does not resolve ({error}): give the nodes' addresses (addresses), or use "
            "image_transport cache"
        ) from None
    found = []
    for info in infos:
        if info[4][0] not in found:
            found.append(info[4][0])
    usable = [a for a in found if not is_loopback(a)] or [a for a in found if a != "127.0.1.1"]
    if not usable:
        raise StreamError(
            f"node {hostname} resolves only to {', '.join(found)} (the Debian 127.0.1.1 trap): give the nodes' "
            "addresses (addresses), or fix /etc/hosts"
        )
    return usable[0]


@dataclass(frozen=True)
class StreamJob:
    """What every node of one run knows alike: who is where, the ports, the token and the limits."""

    token: str
    job_id: str
    rank: int
    hosts: Sequence[str]
    addresses: Sequence[str]
    ports: Sequence[int]
    fanout: int = DEFAULT_FANOUT
    setup_timeout: float = DEFAULT_SETUP_TIMEOUT
    io_timeout: float = DEFAULT_IO_TIMEOUT

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def children(self) -> List[int]:
        return child_ranks(self.rank, self.nnodes, self.fanout)

    def name(self, rank: int) -> str:
        return f"rank {rank} ({self.hosts[rank]})"


# ------------------------------------------------------------------------------------------------------- protocol


def _mac(token: str, kind: str, session: Session, *fields: str) -> str:
    return message_mac(token, "STREAM-" + kind, session, *fields)


def _authentic(offered: str, token: str, kind: str, session: Session, *fields: str) -> bool:
    return bool(_MAC.match(offered)) and hmac.compare_digest(offered, _mac(token, kind, session, *fields))


def format_join(token: str, job_id: str, rank: int, hostname: str, child_nonce: str) -> bytes:
    """A child's first line: the barrier's JOIN, with its proof of the token over the child's nonce. Only an
    authentic JOIN may change what its parent thinks of the child (a local peer without the token cannot mark a
    child gone by joining in its name and hanging up)."""
    mac = _mac(token, "JOIN", Session(job_id, rank, hostname, "", child_nonce))
    return format_join_line(rank, hostname, child_nonce)[:-1] + f" {mac}\n".encode("ascii")


def parse_join(line: bytes, token: str, job_id: str, nnodes: int):
    """(rank, hostname, child nonce) from an authentic JOIN, or ProtocolViolation."""
    head, _, mac = line.rpartition(b" ")
    rank, hostname, child_nonce = parse_join_line(head, nnodes)
    if not _authentic(mac.decode("ascii", "replace"), token, "JOIN", Session(job_id, rank, hostname, "", child_nonce)):
        raise ProtocolViolation(f"rank {rank}: JOIN failed authentication (wrong token, or not this run's)")
    return rank, hostname, child_nonce


def format_hello(token: str, session: Session, image_id: str, size_estimate: int) -> bytes:
    mac = _mac(token, "HELLO", session, image_id, str(size_estimate))
    return f"HELLO {session.rank0_nonce} {image_id} {size_estimate} {mac}\n".encode("ascii")


def parse_hello(line: bytes, token: str, job_id: str, rank: int, hostname: str, child_nonce: str):
    """(session, image ID, size estimate) from a parent's HELLO, or ProtocolViolation."""
    fields = line.decode("ascii", "replace").split(" ")
    if len(fields) != 5 or fields[0] != "HELLO":
        raise ProtocolViolation("not an image stream HELLO (another service, or a barrier on that port)")
    _, parent_nonce, image_id, size_text, mac = fields
    if not _IMAGE_ID.match(image_id) or not _DECIMAL.match(size_text):
        raise ProtocolViolation("malformed HELLO: the image ID or the size is not well formed")
    session = Session(job_id, rank, hostname, parent_nonce, child_nonce)
    if not _authentic(mac, token, "HELLO", session, image_id, size_text):
        raise ProtocolViolation("HELLO failed authentication: not this run's sender (another job, or an impostor)")
    return session, image_id, int(size_text)


def format_want(token: str, session: Session, need: bool) -> bytes:
    flag = "need" if need else "have"
    return f"WANT {flag} {_mac(token, 'WANT', session, flag)}\n".encode("ascii")


def parse_want(line: bytes, token: str, session: Session) -> bool:
    """Whether the child's subtree needs the image, or ProtocolViolation."""
    fields = line.decode("ascii", "replace").split(" ")
    if len(fields) != 3 or fields[0] != "WANT" or fields[1] not in ("need", "have"):
        raise ProtocolViolation("malformed WANT")
    if not _authentic(fields[2], token, "WANT", session, fields[1]):
        raise ProtocolViolation(f"rank {session.rank}: WANT failed authentication (wrong token)")
    return fields[1] == "need"


def control_payload(token: str, session: Session, kind: bytes, *fields: str) -> bytes:
    """The payload of an END, ABORT or SKIP frame on `session`'s connection."""
    name = {END: "END", ABORT: "ABORT", SKIP: "SKIP"}[kind]
    mac = _mac(token, name, session, *fields)
    if kind == END:
        return f"{fields[0]} {fields[1]} {mac}".encode("ascii")
    if kind == ABORT:
        return f"{mac} {fields[0]}".encode("ascii")
    return mac.encode("ascii")


def parse_control(kind: bytes, payload: bytes, token: str, session: Session) -> tuple:
    """END -> (size, sha256); ABORT -> (reason,); SKIP -> (); StreamBroken when malformed or not authentic."""
    text = payload.decode("ascii", "replace")
    if kind == END:
        fields = text.split(" ")
        if len(fields) == 3 and _DECIMAL.match(fields[0]) and _SHA256.match(fields[1]):
            if _authentic(fields[2], token, "END", session, fields[0], fields[1]):
                return int(fields[0]), fields[1]
        raise StreamBroken("the stream's trailer is malformed or failed authentication")
    if kind == ABORT:
        mac, _, reason = text.partition(" ")
        if _authentic(mac, token, "ABORT", session, reason):
            return (reason,)
        raise StreamBroken("an ABORT that failed authentication")
    if _authentic(text, token, "SKIP", session):
        return ()
    raise StreamBroken("a SKIP that failed authentication")


def printable(text: str, limit: int = 400) -> str:
    return "".join(char if " " <= char <= "~" else "?" for char in text)[:limit]


class Channel:
    """One TCP connection with a receive buffer: lines (bounded) and frames (bounded), each within a deadline."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self._buffer = bytearray()

    def _fill(self, until: float) -> None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        self.sock.settimeout(remaining)
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise StreamBroken(f"{self.peer} closed the connection")
        self._buffer += chunk

    def read_line(self, until: float) -> bytes:
        while True:
            line = take_line(self._buffer)
            if line is not None:
                return line
            if len(self._buffer) >= MAX_LINE_BYTES:
                raise ProtocolViolation(f"a line longer than {MAX_LINE_BYTES} bytes")
            self._fill(until)

    def read_line_arrived(self) -> Optional[bytes]:
        """One receive of what has arrived on a readable socket; a whole line if there is one by now."""
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise StreamBroken(f"{self.peer} closed the connection")
        self._buffer += chunk
        line = take_line(self._buffer)
        if line is None and len(self._buffer) >= MAX_LINE_BYTES:
            raise ProtocolViolation(f"a line longer than {MAX_LINE_BYTES} bytes")
        return line

    def read_exact(self, count: int, timeout: float) -> bytearray:
        """`count` bytes; each receive may wait `timeout` (a stalled sender is a broken stream)."""
        data = bytearray(count)
        view = memoryview(data)
        got = min(count, len(self._buffer))
        view[:got] = self._buffer[:got]
        del self._buffer[:got]
        self.sock.settimeout(timeout)
        while got < count:
            received = self.sock.recv_into(view[got:], count - got)
            if not received:
                raise StreamBroken(f"{self.peer} closed the connection mid-stream")
            got += received
        return data

    def read_frame(self, timeout: float):
        kind, length = FRAME_HEADER.unpack(bytes(self.read_exact(FRAME_HEADER.size, timeout)))
        limit = MAX_DATA_BYTES if kind == DATA else MAX_CONTROL_BYTES
        if kind not in (DATA, END, ABORT, SKIP) or length > limit:
            raise StreamBroken(f"garbage from {self.peer}: a frame of type {kind!r} and {length} bytes")
        return kind, self.read_exact(length, timeout)

    def send(self, data, timeout: float) -> None:
        self.sock.settimeout(timeout)
        self.sock.sendall(data)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Fanout:
    """The children a node forwards to; a child whose connection fails is dropped (it falls back to the cache)."""

    def __init__(self, token: str, children: Dict[int, tuple], io_timeout: float):
        self._token = token
        self._io_timeout = io_timeout
        self.children = dict(children)  # rank -> (Channel, Session, needs)
        self.dropped: Dict[int, str] = {}

    @property
    def needed(self) -> bool:
        return any(needs for _, _, needs in self.children.values())

    def _send(self, rank: int, frames: Sequence[bytes]) -> None:
        channel = self.children[rank][0]
        try:
            for frame in frames:
                channel.send(frame, self._io_timeout)
        except OSError as error:
            self.dropped[rank] = f"sending to it failed: {getattr(error, 'strerror', None) or error}"
            channel.close()
            del self.children[rank]

    def data(self, chunk) -> None:
        header = FRAME_HEADER.pack(DATA, len(chunk))
        for rank in list(self.children):
            self._send(rank, (header, chunk))

    def _control(self, rank: int, kind: bytes, *fields: str) -> None:
        payload = control_payload(self._token, self.children[rank][1], kind, *fields)
        self._send(rank, (FRAME_HEADER.pack(kind, len(payload)) + payload,))

    def control(self, kind: bytes, *fields: str) -> None:
        for rank in list(self.children):
            self._control(rank, kind, *fields)

    def release_unneeded(self) -> None:
        """Send SKIP to each child whose whole subtree holds the image and let it go: it gets no byte, and is not
        kept waiting for a trailer that comes only after the whole image."""
        for rank, (channel, _, needs) in list(self.children.items()):
            if not needs:
                self._control(rank, SKIP)
                channel.close()
                self.children.pop(rank, None)

    def end(self, size: int, sha256: str) -> None:
        self.control(END, str(size), sha256)

    def abort(self, reason: str) -> None:
        self.control(ABORT, printable(reason))

    def close(self) -> None:
        for channel, _, _ in self.children.values():
            channel.close()
        self.children.clear()


# ------------------------------------------------------------------------------------------------ setting up hops


def listen(address: str, ports: Sequence[int]) -> socket.socket:
    """A listener on `address` at the first free candidate port."""
    errors = []
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            sock.listen(64)
            return sock
        except OSError as error:
            sock.close()
            errors.append(f"{port}: {error.strerror or error}")
    raise StreamError(f"cannot listen on {address} at any of the ports {', '.join(errors)} (another job's?)")


def admit_children(
    listener: socket.socket, job: StreamJob, image_id: str, size_estimate: int, deadline: float
) -> Dict[int, tuple]:
    """Greet this node's children as they connect, until each told whether its subtree needs the image or the
    deadline passed; rank -> (Channel, Session, needs). Every connection is accepted into the pool of those not
    yet joined (MAX_UNJOINED_CONNECTIONS, JOIN_WAIT); one whose JOIN fails authentication, names a rank that is not
    a child here or comes beyond MAX_GREETINGS_PER_CHILD is closed and forgotten. An authentic JOIN gets a thread
    for its HELLO and WANT. A child that was greeted and then went away without its WANT (it failed: its docker,
    its node) is waited for no longer: it and its subtree load the cache, and the others need not wait the setup
    timeout for it."""
    expected = set(job.children)
    admitted: Dict[int, tuple] = {}
    gone = set()
    greeting = [0]  # authenticated connections being greeted now
    lock = threading.Lock()

    def greet(channel: Channel, rank: int, hostname: str, child_nonce: str) -> None:
        try:
            session = Session(job.job_id, rank, hostname, new_nonce(), child_nonce)
            channel.send(format_hello(job.token, session, image_id, size_estimate), 10.0)
            needs = parse_want(channel.read_line(deadline), job.token, session)
        except (ProtocolViolation, StreamBroken, OSError) as error:
            channel.close()
            # Only a child that proved the token may be given up for having gone away.
            if isinstance(error, StreamBroken):
                with lock:
                    gone.add(rank)
            return
        finally:
            with lock:
                greeting[0] -= 1
        with lock:
            if rank in admitted:
                channel.close()
                return
            admitted[rank] = (channel, session, needs)

    def joined(channel: Channel, line: bytes) -> None:
        """An unjoined connection's first line: a thread greets it when it is an authentic JOIN of a child
        still awaited, within the bound; anything else is closed."""
        try:
            rank, hostname, child_nonce = parse_join(line, job.token, job.job_id, job.nnodes)
        except ProtocolViolation:
            channel.close()
            return
        with lock:
            welcome = rank in expected and rank not in admitted
            welcome = welcome and greeting[0] < MAX_GREETINGS_PER_CHILD * len(expected)
            if welcome:
                greeting[0] += 1
        if not welcome:
            channel.close()
            return
        threading.Thread(target=greet, args=(channel, rank, hostname, child_nonce), daemon=True).start()

    with _UnjoinedPool(listener) as pool:
        while time.monotonic() < deadline:
            with lock:
                if set(admitted) | gone >= expected:
                    break
            for channel, line in pool.lines(min(0.2, max(0.0, deadline - time.monotonic()))):
                joined(channel, line)
    with lock:
        return dict(admitted)


class _UnjoinedPool:
    """The listener and the connections accepted from it that have not sent their first line yet, read in one
    thread through a selector: at most MAX_UNJOINED_CONNECTIONS (a new one closes the oldest), each closed after
    JOIN_WAIT seconds without a whole line."""

    def __init__(self, listener: socket.socket):
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._waiting: Dict[socket.socket, tuple] = {}  # socket -> (Channel, until), oldest first

    def __enter__(self) -> _UnjoinedPool:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        return self

    def __exit__(self, *exc) -> None:
        for sock in list(self._waiting):
            self._drop(sock)
        self._selector.close()

    def _drop(self, sock: socket.socket) -> Channel:
        channel, _ = self._waiting.pop(sock)
        self._selector.unregister(sock)
        return channel

    def _accept(self) -> None:
        # At most one pool's worth per call, so the lines of those already waiting are read between batches.
        for _ in range(MAX_UNJOINED_CONNECTIONS):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of file descriptors, say: the kernel keeps the rest in its backlog; a pause, not a busy loop.
                time.sleep(RETRY_PAUSE)
                return
            if len(self._waiting) >= MAX_UNJOINED_CONNECTIONS:
                self._drop(next(iter(self._waiting))).close()
            sock.setblocking(False)
            self._waiting[sock] = (Channel(sock, f"{peer[0]}:{peer[1]}"), time.monotonic() + JOIN_WAIT)
            self._selector.register(sock, selectors.EVENT_READ)

    def lines(self, timeout: float) -> List[tuple]:
        """(Channel, first line) of each connection whose first line arrived within `timeout`; those leave the
        pool (blocking again), as do those that closed, sent garbage or waited past JOIN_WAIT (closed)."""
        arrived = []
        for key, _ in self._selector.select(timeout):
            sock = key.fileobj
            if sock is self._listener:
                self._accept()
                continue
            if sock not in self._waiting:
                continue  # closed as the oldest by that accept
            channel = self._waiting[sock][0]
            try:
                line = channel.read_line_arrived()
            except (BlockingIOError, InterruptedError):
                continue
            except (ProtocolViolation, StreamBroken, OSError):
                self._drop(sock).close()
                continue
            if line is not None:
                self._drop(sock).sock.setblocking(True)
                arrived.append((channel, line))
        now = time.monotonic()
        for sock, (_, until) in list(self._waiting.items()):
            if until <= now:
                self._drop(sock).close()
        return arrived


def join_parent(job: StreamJob, deadline: float):
    """(Channel, Session, image ID, size estimate) of this worker's authenticated connection to its parent."""
    parent = parent_rank(job.rank, job.fanout)
    address = job.addresses[parent]
    last, refused = "nothing answered", ""
    while time.monotonic() < deadline:
        for port in job.ports:
            try:
                sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
            except OSError as error:
                last = f"port {port}: {getattr(error, 'strerror', None) or error}"
                continue
            channel = Channel(sock, f"{address}:{port}")
            nonce = new_nonce()
            try:
                channel.send(format_join(job.token, job.job_id, job.rank, job.hosts[job.rank], nonce), 10.0)
                line = channel.read_line(min(deadline, time.monotonic() + 10.0))
                session, image_id, size = parse_hello(line, job.token, job.job_id, job.rank, job.hosts[job.rank], nonce)
                return channel, session, image_id, size
            except ProtocolViolation as error:
                refused = f"; port {port} refused: {error}"
                channel.close()
            except (StreamBroken, OSError) as error:
                last = f"port {port}: {error}"
                channel.close()
        time.sleep(RETRY_PAUSE)
    raise StreamBroken(f"could not join the stream of {job.name(parent)} at {address}: {last}{refused}")
