"""The streamed image transport: rank 0's `docker save` reaches every worker's `docker load` over TCP, in one pass.

Rank 0 runs `docker save` once and tees the bytes into the shared cache entry (the same file and marker the
publish path writes, so a later job still finds the tar) and to its children; every worker pipes what it receives
into `docker load` as it arrives and forwards it to its own children: nodes form a tree of `fanout` children per
node (fanout 1: a chain 0 -> 1 -> 2 ...), so save, transfer and every load overlap and the shared filesystem serves
the image once, not once per node. When the cache already holds the entry, rank 0 streams that file instead.

Each hop is plain TCP from a child to its parent's address on a port derived from the job like the barrier's
(`derive_stream_ports`), authenticated with the run's barrier token as the barrier is (HMAC over the other side's
fresh nonce, the token never on the wire). A connection opens with lines of at most MAX_LINE_BYTES:

    child  -> parent  JOIN <rank> <hostname> <child-nonce> <mac>            the barrier's JOIN, and the child's
                                                                          proof of the token over its nonce
    parent -> child   HELLO <parent-nonce> <image-id> <size-estimate> <mac>  proves the parent holds the token
    child  -> parent  WANT <need|have> <mac>                               proves the child holds it; whether its
                                                                          subtree needs the image
then frames from parent to child, each a type byte, a 4-byte big-endian length and the payload:

    D  data, at most MAX_DATA_BYTES
    E  <size> <sha256> <mac>   the end: what the whole stream must have been
    A  <mac> <reason>          the sender gave up (the receivers fall back to the shared cache)
    S  <mac>                   skip: no node below needs the image

Every receiver holds the last bytes back from `docker load` (image_cache_load.HeldBackTail, the cache load's own
logic) until size and sha256 match the trailer, so a stream that breaks (a sender or a hop died) or carries a
wrong byte aborts every `docker load` downstream before the daemon can register anything; the nodes still missing
the image then load the shared tar cache, which rank 0 writes whatever happens to the stream (rank 0's heartbeat
file beside the entry tells them when rank 0 itself died, so they fail at once instead of waiting for an entry that
will never come). A node that already holds the image only forwards, and rank 0 skips the transfer when no node
needs it. Memory per hop is bounded: one frame plus the held-back tail. Standard library and the docker CLI only (py38).
"""

from __future__ import annotations

import hmac
import json
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ansible.module_utils.docker_cli import DockerError, run_docker
from ansible.module_utils.image.announcement import HEARTBEAT_STALE_SECONDS
from ansible.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    MARKER_POLL_INTERVAL,
    CacheDirectory,
    ImageCacheError,
    check_cache_dir,
    entry_key,
    remove_quietly,
)
from ansible.module_utils.image.cache.load import HeldBackLoad, load_image
from ansible.module_utils.image.cache.publish import publish_image
from ansible.module_utils.slurm.allocation import is_loopback
from ansible.module_utils.wire import (
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
)

FRAME_HEADER = struct.Struct(">cI")
MAX_DATA_BYTES = CHUNK_BYTES
MAX_CONTROL_BYTES = 1024
DEFAULT_FANOUT = 1
DEFAULT_SETUP_TIMEOUT = 120.0
DEFAULT_IO_TIMEOUT = 120.0
DEFAULT_FALLBACK_WAIT = 300.0
CONNECT_TIMEOUT = 2.0
RETRY_PAUSE = 0.1
PROGRESS_MIN_BYTES = 1 << 30  # images over 1 GB report bytes and rate as they go
PROGRESS_INTERVAL = 5.0
HEARTBEAT_INTERVAL = 2.0
DATA, END, ABORT, SKIP = b"D", b"E", b"A", b"S"
# Connections a node greets at once, per child it waits for: the real child, and a few strays or retries.
MAX_GREETINGS_PER_CHILD = 4

_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,18})\Z")
_MAC = re.compile(r"[0-9a-f]{64}\Z")


class StreamError(Exception):
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


def _printable(text: str, limit: int = 400) -> str:
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
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) >= MAX_LINE_BYTES:
                raise ProtocolViolation(f"a line longer than {MAX_LINE_BYTES} bytes")
            self._fill(until)

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
        self.control(ABORT, _printable(reason))

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
    deadline passed; rank -> (Channel, Session, needs). A connection that fails authentication, names a rank
    that is not a child here or comes second for a rank is closed and forgotten. A child that was greeted and then
    went away without its WANT (it failed: its docker, its node) is waited for no longer: it and its subtree load
    the cache, and the others need not wait the setup timeout for it."""
    expected = set(job.children)
    admitted: Dict[int, tuple] = {}
    gone = set()
    greeting = [0]  # connections being greeted now
    lock = threading.Lock()

    def greet(sock: socket.socket, peer) -> None:
        channel = Channel(sock, f"{peer[0]}:{peer[1]}")
        rank = None
        try:
            rank, hostname, child_nonce = parse_join(
                channel.read_line(time.monotonic() + 10.0), job.token, job.job_id, job.nnodes
            )
            with lock:
                if rank not in expected or rank in admitted:
                    raise ProtocolViolation(f"rank {rank} is not a child of rank {job.rank} waiting here")
            session = Session(job.job_id, rank, hostname, new_nonce(), child_nonce)
            channel.send(format_hello(job.token, session, image_id, size_estimate), 10.0)
            needs = parse_want(channel.read_line(deadline), job.token, session)
        except (ProtocolViolation, StreamBroken, OSError) as error:
            channel.close()
            # Only a child that proved the token may be given up for having gone away.
            if rank in expected and isinstance(error, StreamBroken):
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

    listener.settimeout(0.2)
    while time.monotonic() < deadline:
        with lock:
            if set(admitted) | gone >= expected:
                break
        try:
            sock, peer = listener.accept()
        except socket.timeout:
            continue
        with lock:
            # A flood of connections gets no thread each: beyond a few per child, a new one is closed at once.
            full = greeting[0] >= MAX_GREETINGS_PER_CHILD * len(expected)
            if not full:
                greeting[0] += 1
        if full:
            sock.close()
            continue
        threading.Thread(target=greet, args=(sock, peer), daemon=True).start()
    with lock:
        return dict(admitted)


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


# ------------------------------------------------------------------------------------------------------ progress


class Progress:
    """Bytes and rate so far, handed to `report` every PROGRESS_INTERVAL seconds for images over 1 GB."""

    def __init__(self, size_estimate: int, report: Optional[Callable[[dict], None]]):
        self.started = time.monotonic()
        self.bytes = 0
        self._report = report if report and size_estimate > PROGRESS_MIN_BYTES else None
        self._size = size_estimate
        self._next = self.started + PROGRESS_INTERVAL

    def add(self, count: int) -> None:
        self.bytes += count
        if self._report and time.monotonic() >= self._next:
            self._next = time.monotonic() + PROGRESS_INTERVAL
            self._report(self.figures())

    def figures(self) -> dict:
        seconds = max(1e-6, time.monotonic() - self.started)
        return {
            "bytes": self.bytes,
            "size_estimate": self._size,
            "seconds": round(seconds, 3),
            "rate_mb_s": round(self.bytes / seconds / 1e6, 1),
        }


# --------------------------------------------------------------------------------------------- rank 0's heartbeat


def heartbeat_path(cache: CacheDirectory, key: str) -> str:
    """Where rank 0 shows it is still writing entry `key`: a temporary file's name, so `prune` removes one left
    behind by a killed rank 0 after an hour."""
    return os.path.join(cache.root, f".{key}.publisher.json.tmp")


class PublisherHeartbeat:
    """Rank 0 rewrites its heartbeat file every `interval` seconds while it streams and writes the cache entry,
    and removes it when done: a worker whose stream broke then knows whether the entry will still come."""

    def __init__(self, cache: CacheDirectory, key: str, interval: float = HEARTBEAT_INTERVAL):
        self.path = heartbeat_path(cache, key)
        self._root = cache.root
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._beats = 0

    def __enter__(self) -> PublisherHeartbeat:
        if check_cache_dir(self._root, create=True):
            self._beat()
            self._thread.start()
        return self

    def _beat(self) -> None:
        self._beats += 1
        beat = {"host": socket.gethostname(), "pid": os.getpid(), "beat": self._beats}
        try:
            with open(self.path, "w") as handle:
                handle.write(json.dumps(beat))
        except OSError:
            pass  # a missed beat: the workers' patience covers several

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        remove_quietly(self.path)


def wait_for_rank0_entry(
    cache: CacheDirectory, key: str, wait: float, rank0: str, stale_after: float = HEARTBEAT_STALE_SECONDS
) -> None:
    """Wait up to `wait` seconds for rank 0 to commit entry `key`, but raise StreamError as soon as its heartbeat
    says it died (stood still `stale_after` seconds) or ended without committing (gone, and no marker)."""
    path = heartbeat_path(cache, key)
    started = time.monotonic()
    last_beat, last_change, seen = None, started, False
    while time.monotonic() - started < wait:
        if cache.wait_for_marker(key, 0) is not None:
            return
        try:
            with open(path) as handle:
                beat = handle.read()
        except OSError:
            beat = None
        now = time.monotonic()
        # The marker is committed before the beat goes: no beat and no marker means rank 0 gave up.
        if beat is None and seen and cache.wait_for_marker(key, 0) is None:
            raise StreamError(
                f"{rank0} ended without committing the shared cache entry {cache.tar_path(key)}: its image_stream "
                "task failed (its error says why); nothing was loaded on this node"
            )
        if beat != last_beat:
            last_beat, last_change, seen = beat, now, seen or beat is not None
        elif beat is not None and now - last_change > stale_after:
            raise StreamError(
                f"{rank0} died while writing the shared cache entry: its heartbeat {path} stood still for "
                f"{stale_after:g} s (its image_stream module or its node is gone); nothing was loaded on this node. "
                "Run the job again, or exclude that node"
            )
        time.sleep(MARKER_POLL_INTERVAL)


# ------------------------------------------------------------------------------------------------------ rank 0


def send_image(
    cache: CacheDirectory,
    image: str,
    job: StreamJob,
    announce: Optional[Callable[[str], None]] = None,
    report: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Rank 0: stream `image` to the tree below, writing the cache entry on the way; what was done.

    `announce(image_id)` is called once the listener is up (pull mode writes rank 0's announcement then). The
    cache entry is written whatever happens to the stream: it is every node's fallback.
    """
    started = time.monotonic()
    inspected = cache.inspect(image)
    if inspected is None:
        raise StreamError(f"image {image!r} is not on this node's Docker daemon: build or load it before streaming")
    image_id = inspected["Id"]
    with PublisherHeartbeat(cache, entry_key(image_id)):
        result = _send(cache, image, image_id, int(inspected.get("Size") or 0), job, announce, report)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _send(cache, image, image_id, size_estimate, job, announce, report) -> dict:
    listener = listen(job.addresses[job.rank], job.ports) if job.children else None
    try:
        if announce:
            announce(image_id)
        children = (
            admit_children(listener, job, image_id, size_estimate, time.monotonic() + job.setup_timeout)
            if listener
            else {}
        )
    finally:
        if listener:
            listener.close()
    fanout = Fanout(job.token, children, job.io_timeout)
    missing = {rank: "never joined" for rank in job.children if rank not in children}
    result = {"image_id": image_id, "bytes": 0, "changed": False, "stream_error": None}
    try:
        fanout.release_unneeded()
        if not fanout.needed:
            result.update(action_taken="skipped")
            if missing:  # a child that never joined loads the cache instead: it must be there
                published = publish_image(cache, image)
                result.update(_rank0_result("saved", published, None, Progress(0, None)))
        else:
            result.update(_stream_from_rank0(cache, image, image_id, fanout, Progress(size_estimate, report)))
    finally:
        fanout.close()
    missing.update(fanout.dropped)
    result["children_lost"] = {job.name(rank): why for rank, why in sorted(missing.items())}
    return result


def _stream_from_rank0(cache: CacheDirectory, image: str, image_id: str, fanout: Fanout, progress: Progress) -> dict:
    key = entry_key(image_id)
    tar = cache.tar_path(key)
    marker = cache.read_marker(key) if check_cache_dir(cache.root, create=True) else None
    if marker is not None and os.path.exists(tar) and os.path.getsize(tar) == marker["size"]:
        return _stream_file(tar, marker, fanout, progress)

    def tee(chunk) -> None:
        fanout.data(chunk)
        progress.add(len(chunk))

    try:
        published = publish_image(cache, image, tee=tee)
    except (ImageCacheError, DockerError) as error:
        # The workers' loads are aborted; the cache entry, written the plain way, is what they load instead.
        fanout.abort(f"rank 0 could not stream {image}: {error}. Loading the shared tar cache instead")
        published = publish_image(cache, image)
        return _rank0_result("saved", published, str(error), progress)
    if published.streamed is None:  # another publisher committed the entry meanwhile: stream that file
        return _stream_file(tar, cache.read_marker(key), fanout, progress)
    fanout.end(*published.streamed)
    return _rank0_result("streamed", published, None, progress)


def _rank0_result(action: str, published, error: Optional[str], progress: Progress) -> dict:
    figures = progress.figures()
    return {
        "action_taken": action,
        "changed": True,
        "entry": published.entry,
        "bytes": published.bytes,
        "rate_mb_s": figures["rate_mb_s"],
        "stream_error": error,
    }


def _stream_file(tar: str, marker: dict, fanout: Fanout, progress: Progress) -> dict:
    """Stream a committed entry's tar (read once): a later job's image, already in the cache."""
    with open(tar, "rb") as source:
        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
            fanout.data(chunk)
            progress.add(len(chunk))
    if progress.bytes != int(marker["size"]):
        fanout.abort(f"cache entry {tar} changed size while it was streamed")
        raise StreamError(f"cache entry {tar} has {progress.bytes} bytes, its marker says {marker['size']}")
    # The receivers check the marker's hash: a damaged entry aborts their loads, as the cache load would.
    fanout.end(int(marker["size"]), marker["sha256"])
    return {
        "action_taken": "streamed-from-cache",
        "changed": False,
        "entry": tar,
        "bytes": progress.bytes,
        "rate_mb_s": progress.figures()["rate_mb_s"],
        "stream_error": None,
    }


# ------------------------------------------------------------------------------------------------------ workers


def receive_image(
    cache: CacheDirectory,
    job: StreamJob,
    image: Optional[str] = None,
    image_id: Optional[str] = None,
    fallback_wait: float = DEFAULT_FALLBACK_WAIT,
    report: Optional[Callable[[dict], None]] = None,
    open_load: Optional[Callable[[], HeldBackLoad]] = None,
    heartbeat_stale: float = HEARTBEAT_STALE_SECONDS,
) -> dict:
    """A worker: receive the stream from its parent into `docker load`, forward it to its children, and fall back
    to the shared cache when the stream breaks; what was done. `image_id` (pull mode's announcement) is what
    the stream must carry; without it the parent's HELLO names it. `open_load` makes the held-back load (tests);
    `heartbeat_stale`: how long rank 0's heartbeat may stand still before the fallback wait gives up."""
    started = time.monotonic()
    deadline = started + job.setup_timeout
    open_load = open_load or (lambda: HeldBackLoad(cache.docker_timeout, cache.docker_host))
    listener = listen(job.addresses[job.rank], job.ports) if job.children else None
    fanout = Fanout(job.token, {}, job.io_timeout)
    result = {"bytes": 0, "changed": False, "stream_error": None}
    parent = None
    try:
        try:
            parent, session, announced, size_estimate = join_parent(job, deadline)
            if image_id and announced != image_id:
                raise StreamBroken(f"the stream carries image {announced}, rank 0 announced {image_id}")
            image_id = announced
            holds = cache.image_id_of(image_id) == image_id
            if listener:
                fanout.children.update(admit_children(listener, job, image_id, size_estimate, deadline))
                listener.close()
                listener = None
            parent.send(format_want(job.token, session, not holds or fanout.needed), job.io_timeout)
            fanout.release_unneeded()
            progress = Progress(size_estimate, report)
            action = _relay(parent, session, job, fanout, None if holds else open_load, progress)
            result.update(bytes=progress.bytes, rate_mb_s=progress.figures()["rate_mb_s"])
            if holds:
                action = "already-present"
        except (StreamBroken, ProtocolViolation, OSError, DockerError) as error:
            reason = str(error) or type(error).__name__
            fanout.abort(f"{job.name(job.rank)} lost the stream: {reason}")
            result["stream_error"] = f"{job.name(job.rank)}: {reason}"
            action = None
    finally:
        fanout.close()
        if listener:
            listener.close()
        if parent:
            parent.close()
    result["children_lost"] = {job.name(rank): why for rank, why in sorted(fanout.dropped.items())}
    if action is None:
        if not image_id:
            raise StreamError(
                f"{result['stream_error']}; and this node does not know rank 0's image ID to load it from the "
                "shared tar cache instead (give image_id)"
            )
        if cache.image_id_of(image_id) != image_id:
            wait_for_rank0_entry(cache, entry_key(image_id), fallback_wait, job.name(0), heartbeat_stale)
        loaded = load_image(cache, image_id, image=image, marker_wait=0)
        action = "already-present" if loaded.action_taken in ("already-present", "tagged") else "loaded-from-cache"
        result.update(entry=loaded.entry, bytes=loaded.bytes)
    elif action == "streamed" and cache.image_id_of(image_id) != image_id:
        raise StreamError(
            f"the stream was loaded, but this node's daemon has no image {image_id} afterwards: the stream held "
            "another image (or this daemon's image store names images differently from rank 0's)"
        )
    if image and action != "skipped" and cache.image_id_of(image) != image_id:
        run_docker(["tag", image_id, image], timeout=cache.docker_timeout, host=cache.docker_host)
        result["changed"] = True
    result.update(
        action_taken=action,
        image_id=image_id,
        changed=result["changed"] or action in ("streamed", "loaded-from-cache"),
        seconds=round(time.monotonic() - started, 3),
    )
    return result


def _relay(parent: Channel, session: Session, job: StreamJob, fanout: Fanout, open_load, progress: Progress) -> str:
    """Pass the parent's frames on to the children and into docker load until the trailer; the action taken."""
    load = None
    try:
        while True:
            kind, payload = parent.read_frame(job.io_timeout)
            if kind == DATA:
                fanout.data(payload)
                if open_load is not None:
                    if load is None:
                        load = open_load()
                    load.feed(payload)
                progress.add(len(payload))
                continue
            fields = parse_control(kind, payload, job.token, session)
            if kind == SKIP:
                fanout.control(SKIP)
                if open_load is not None:
                    raise StreamBroken("the sender skipped the transfer, but this node lacks the image")
                return "skipped"
            if kind == ABORT:
                fanout.abort(fields[0])
                raise StreamBroken(f"the sender gave up: {fields[0]}")
            size, sha256 = fields
            fanout.end(size, sha256)
            if open_load is None:
                return "forwarded"
            if load is None:
                load = open_load()
            found = load.mismatch(size, sha256)
            if found:
                raise StreamBroken(
                    f"the stream does not match its trailer: it has {found}, the trailer says {size} bytes with "
                    f"sha256 {sha256} (a byte changed on the way). Nothing was loaded"
                )
            load.finish()
            return "streamed"
    finally:
        if load is not None:
            load.__exit__(None, None, None)
