"""The streamed image transport's protocol over real sockets on loopback addresses: framing, authentication, the
trailer check and corruption, with in-memory loads; then rank 0 to a worker with real Docker daemons (the cache
entry the stream writes is byte-identical to the publish path's, a corrupted byte loads nothing)."""

import hashlib
import json
import os
import selectors
import socket
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image import stream as image_stream
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image import stream_protocol
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    ImageCacheError,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import (
    LOAD_HOLD_BACK_BYTES,
    HeldBackTail,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.tar_cache import ImageCache
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream import (
    PublisherHeartbeat,
    receive_image,
    send_image,
    wait_for_rank0_entry,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream_protocol import (
    Fanout,
    StreamError,
    StreamJob,
    admit_children,
    child_ranks,
    listen,
    parent_rank,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.wire import (
    ProtocolViolation,
    Session,
    format_join_line,
    new_nonce,
)

TOKEN = "s3cr3t-stream-token-0123456789"
IMAGE_ID = "sha256:" + "ab" * 32


def free_ports(count=3):
    """Ports free on loopback just now (the kernel's pick), as every node's candidate list."""
    ports = []
    for _ in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def make_jobs(nnodes, token=TOKEN, fanout=1, setup_timeout=10.0, io_timeout=5.0, base=101):
    ports = free_ports()
    hosts = [f"node{rank + 1}" for rank in range(nnodes)]
    addresses = [f"127.0.0.{base + rank}" for rank in range(nnodes)]
    return [
        StreamJob(token, "4242", rank, hosts, addresses, ports, fanout, setup_timeout, io_timeout)
        for rank in range(nnodes)
    ]


class MemoryLoad(HeldBackTail):
    """A held-back load into memory: what `docker load` would have read, and whether it was let finish."""

    def __init__(self, daemon):
        self.received = bytearray()
        super().__init__(self.received.extend)
        self.daemon = daemon
        self.aborted = False
        self.finished = False

    def mismatch(self, size, sha256):
        found = super().mismatch(size, sha256)
        self.aborted = bool(found)
        return found

    def finish(self):
        self.release()
        self.finished = True
        self.daemon.images.add(self.daemon.image_id_for(bytes(self.received)))

    def __exit__(self, *exc_info):
        if not self.finished:
            self.aborted = True


class MemoryDaemon(CacheDirectory):
    """A node's daemon in memory: the image IDs it holds; a 'load' registers IMAGE_ID for the payload sent."""

    def __init__(self, root, payload, holds=False):
        super().__init__(str(root))
        self.payload = payload
        self.images = {IMAGE_ID} if holds else set()
        self.loads = []

    def image_id_for(self, data):
        return IMAGE_ID if data == self.payload else "sha256:" + hashlib.sha256(data).hexdigest()

    def image_id_of(self, ref):
        return ref if ref in self.images else None

    def open_load(self):
        load = MemoryLoad(self)
        self.loads.append(load)
        return load


def run_receivers(jobs, daemons, tmp_path, **kwargs):
    """Start receive_image for every worker in a thread; a list to join: each thread's result or error."""
    outcomes = [None] * len(jobs)
    threads = []
    for job, daemon in zip(jobs[1:], daemons[1:], strict=True):

        def run(job=job, daemon=daemon):
            try:
                outcomes[job.rank] = receive_image(daemon, job, fallback_wait=0.2, open_load=daemon.open_load, **kwargs)
            except Exception as error:  # noqa: BLE001 - the test looks at it
                outcomes[job.rank] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    return outcomes, threads


def serve(job, payload, chunk=65536, size_estimate=0, cut_after=None, trailer=None, deadline=None):
    """Rank 0's side with the module's own parts (listen, admit_children, Fanout): stream `payload` and its
    trailer, or stop after `cut_after` bytes (the sender dies: connections closed, no trailer)."""
    listener = listen(job.addresses[0], job.ports)
    children = admit_children(listener, job, IMAGE_ID, size_estimate, deadline or time.monotonic() + 10)
    listener.close()
    fanout = Fanout(job.token, children, job.io_timeout)
    fanout.release_unneeded()
    needed = fanout.needed
    if needed:
        for offset in range(0, len(payload), chunk):
            if cut_after is not None and offset >= cut_after:
                break
            fanout.data(payload[offset : offset + chunk])
        else:
            fanout.end(*(trailer or (len(payload), hashlib.sha256(payload).hexdigest())))
    fanout.close()
    return children, needed


@pytest.fixture
def payload():
    return os.urandom(3 * 1024 * 1024 + 12345)


def join_all(threads):
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


# -- tree and ports ----------------------------------------------------------------------------------------------


def test_a_chain_and_a_tree_reach_every_rank_once():
    for nnodes in (1, 2, 3, 8, 64):
        for fanout in (1, 2, 3):
            reached = [rank for parent in range(nnodes) for rank in child_ranks(parent, nnodes, fanout)]
            assert sorted(reached) == list(range(1, nnodes))
            assert all(rank in child_ranks(parent_rank(rank, fanout), nnodes, fanout) for rank in reached)
    assert child_ranks(1, 3, 1) == [2]


def test_stream_ports_are_the_barriers_derivation_but_never_its_list():
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.wire import derive_barrier_ports

    ports = stream_protocol.derive_stream_ports(29500, "4242")
    assert ports == stream_protocol.derive_stream_ports(29500, "4242")
    assert ports != derive_barrier_ports(29500, "4242")
    assert all(20000 <= port <= 29999 for port in ports)


def test_a_node_name_resolving_only_to_the_debian_trap_is_refused(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0))])
    with pytest.raises(stream_protocol.StreamError, match="127.0.1.1"):
        stream_protocol.node_address("node9")


# -- the stream --------------------------------------------------------------------------------------------------


def test_a_three_node_chain_delivers_the_exact_bytes_and_loads_only_after_the_trailer(tmp_path, payload):
    jobs = make_jobs(3)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in jobs]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    children, needed = serve(jobs[0], payload)
    join_all(threads)

    assert needed and list(children) == [1]
    for rank in (1, 2):
        assert outcomes[rank]["action_taken"] == "streamed", outcomes[rank]
        assert outcomes[rank]["image_id"] == IMAGE_ID and outcomes[rank]["bytes"] == len(payload)
        (load,) = daemons[rank].loads
        assert bytes(load.received) == payload and load.finished and not load.aborted
        assert IMAGE_ID in daemons[rank].images


def test_a_node_holding_the_image_only_forwards(tmp_path, payload):
    jobs = make_jobs(3)
    daemons = [MemoryDaemon(tmp_path, payload, holds=rank == 1) for rank in range(3)]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    serve(jobs[0], payload)
    join_all(threads)

    assert outcomes[1]["action_taken"] == "already-present" and daemons[1].loads == []
    assert outcomes[1]["bytes"] == len(payload)  # it forwarded them
    assert outcomes[2]["action_taken"] == "streamed" and bytes(daemons[2].loads[0].received) == payload


def test_the_transfer_is_skipped_when_every_node_holds_the_image(tmp_path, payload):
    jobs = make_jobs(3)
    daemons = [MemoryDaemon(tmp_path, payload, holds=True) for _ in range(3)]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    _, needed = serve(jobs[0], payload)
    join_all(threads)

    assert not needed
    assert [outcomes[rank]["action_taken"] for rank in (1, 2)] == ["already-present", "already-present"]
    assert [outcomes[rank]["bytes"] for rank in (1, 2)] == [0, 0]


def test_a_node_whose_subtree_holds_the_image_gets_no_byte(tmp_path, payload):
    # The tree 0 -> 1, 2; 1 -> 3, 4: rank 2 holds the image (a leaf), rank 1 holds it but its children do not.
    jobs = make_jobs(5, fanout=2)
    daemons = [MemoryDaemon(tmp_path, payload, holds=rank in (1, 2)) for rank in range(5)]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    serve(jobs[0], payload)
    join_all(threads)

    assert outcomes[2]["action_taken"] == "already-present" and outcomes[2]["bytes"] == 0, outcomes[2]
    assert outcomes[2]["stream_error"] is None
    assert outcomes[1]["action_taken"] == "already-present" and outcomes[1]["bytes"] == len(payload)
    assert [outcomes[rank]["action_taken"] for rank in (3, 4)] == ["streamed", "streamed"]


def test_a_tree_of_seven_workers_with_fanout_two(tmp_path, payload):
    jobs = make_jobs(8, fanout=2)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in jobs]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    children, _ = serve(jobs[0], payload)
    join_all(threads)

    assert sorted(children) == [1, 2]
    assert all(outcomes[rank]["action_taken"] == "streamed" for rank in range(1, 8)), outcomes


def test_a_sender_dying_mid_stream_aborts_every_load_downstream(tmp_path, payload):
    jobs = make_jobs(3)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in jobs]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    serve(jobs[0], payload, cut_after=2 * 1024 * 1024)
    join_all(threads)

    for rank in (1, 2):
        # No cache entry to fall back on here: the fallback's own error, after the stream's.
        assert isinstance(outcomes[rank], ImageCacheError), outcomes[rank]
        (load,) = daemons[rank].loads
        assert load.aborted and not load.finished
        assert load.size - len(load.received) >= LOAD_HOLD_BACK_BYTES  # the tail never reached docker load
        assert IMAGE_ID not in daemons[rank].images


def test_a_wrong_trailer_aborts_every_load(tmp_path, payload):
    jobs = make_jobs(3)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in jobs]
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    serve(jobs[0], payload, trailer=(len(payload), "0" * 64))
    join_all(threads)
    for rank in (1, 2):
        assert isinstance(outcomes[rank], ImageCacheError)
        assert daemons[rank].loads[0].aborted and IMAGE_ID not in daemons[rank].images


class CorruptingProxy:
    """A man in the middle on loopback: listens where rank 1 listens, connects to rank 1, relays both ways and
    flips one byte of what the parent sends at `offset`. It also keeps every byte that passed."""

    def __init__(self, listen_address, target, offset):
        self.sock = socket.create_server((listen_address, target[1]))
        self.target = target
        self.offset = offset
        self.seen = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            down, _ = self.sock.accept()
            try:
                up = socket.create_connection(self.target)
            except OSError:  # the node behind is not listening yet: the connecting side retries
                down.close()
                continue
            threading.Thread(target=self._relay, args=(down, up), daemon=True).start()

    def _relay(self, down, up):

        def pump(source, sink, flip):
            passed = 0
            while True:
                data = source.recv(65536)
                if not data:
                    sink.close()
                    return
                data = bytearray(data)
                if flip and passed <= self.offset < passed + len(data):
                    data[self.offset - passed] ^= 0x01
                passed += len(data)
                self.seen.extend(data)
                sink.sendall(data)

        threading.Thread(target=pump, args=(down, up, False), daemon=True).start()
        pump(up, down, True)


def test_one_corrupted_byte_between_hops_aborts_every_load_downstream(tmp_path, payload):
    """Rank 2 reaches rank 1 only through a proxy that flips one byte of the data rank 1 forwards."""
    jobs = make_jobs(3)
    proxy_address = "127.0.0.120"
    proxy_port = jobs[0].ports[0]
    # Rank 2 believes rank 1 is at the proxy's address.
    addresses = ["127.0.0.101", proxy_address, "127.0.0.103"]
    rank2 = StreamJob(TOKEN, "4242", 2, jobs[0].hosts, addresses, jobs[0].ports, 1, 10.0, 5.0)
    CorruptingProxy(proxy_address, (jobs[0].addresses[1], proxy_port), offset=500_000)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in range(3)]
    outcomes, threads = run_receivers([jobs[0], jobs[1], rank2], daemons, tmp_path)
    serve(jobs[0], payload)
    join_all(threads)

    assert outcomes[1]["action_taken"] == "streamed"
    assert isinstance(outcomes[2], ImageCacheError), outcomes[2]
    (load,) = daemons[2].loads
    assert load.aborted and IMAGE_ID not in daemons[2].images
    assert load.size - len(load.received) >= LOAD_HOLD_BACK_BYTES


def test_the_token_never_travels_and_a_wrong_token_joins_nothing(tmp_path, payload):
    jobs = make_jobs(2)
    proxy_address = "127.0.0.121"
    relay = StreamJob(TOKEN, "4242", 1, jobs[0].hosts, [proxy_address, "127.0.0.102"], jobs[0].ports, 1, 10.0, 5.0)
    proxy = CorruptingProxy(proxy_address, (jobs[0].addresses[0], jobs[0].ports[0]), offset=-1)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in range(2)]
    outcomes, threads = run_receivers([jobs[0], relay], daemons, tmp_path)
    serve(jobs[0], payload)
    join_all(threads)
    assert outcomes[1]["action_taken"] == "streamed"
    assert TOKEN.encode() not in proxy.seen and len(proxy.seen) > len(payload)

    # A worker with another token is refused by rank 0 at its JOIN: nothing is streamed to it.
    jobs = make_jobs(2, setup_timeout=2.0)
    impostor = StreamJob("another-token", "4242", 1, jobs[0].hosts, jobs[0].addresses, jobs[0].ports, 1, 2.0, 5.0)
    daemons = [MemoryDaemon(tmp_path, payload) for _ in range(2)]
    outcomes, threads = run_receivers([jobs[0], impostor], daemons, tmp_path)
    children, _ = serve(jobs[0], payload, deadline=time.monotonic() + 2.5)
    join_all(threads)
    assert children == {}
    assert isinstance(outcomes[1], stream_protocol.StreamError) and daemons[1].loads == []
    assert "could not join the stream of rank 0 (node1)" in str(outcomes[1])


def test_a_frame_longer_than_the_limit_is_garbage(tmp_path):
    left, right = socket.socketpair()
    left.sendall(stream_protocol.FRAME_HEADER.pack(stream_protocol.DATA, stream_protocol.MAX_DATA_BYTES + 1))
    with pytest.raises(stream_protocol.StreamBroken, match="garbage"):
        stream_protocol.Channel(right, "peer").read_frame(1.0)
    left.sendall(stream_protocol.FRAME_HEADER.pack(b"X", 1) + b"x")
    with pytest.raises(stream_protocol.StreamBroken, match="garbage"):
        stream_protocol.Channel(right, "peer").read_frame(1.0)


# -- with real Docker daemons ----------------------------------------------------------------------------------


@pytest.fixture
def docker_pair(private_dockerd, worker_dockerd, busybox_image, tmp_path):
    """(rank 0's cache, the worker's cache) on one cache dir, the worker's daemon without rank 0's image."""
    worker_dockerd.docker("rmi", "-f", busybox_image[1], check=False)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    return (
        ImageCache(str(cache_dir), docker_host=private_dockerd.host),
        ImageCache(str(cache_dir), docker_host=worker_dockerd.host),
    )


def stream_real(rank0_cache, worker_cache, image, jobs, **kwargs):
    outcome = {}

    def work():
        try:
            outcome["worker"] = receive_image(worker_cache, jobs[1], image=image, fallback_wait=5.0, **kwargs)
        except Exception as error:  # noqa: BLE001
            outcome["worker"] = error

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    outcome["rank0"] = send_image(rank0_cache, image, jobs[0])
    thread.join(60)
    return outcome


def test_rank0_streams_to_a_real_daemon_and_its_cache_entry_is_the_publish_paths(
    docker_pair, private_dockerd, worker_dockerd, busybox_image, tmp_path
):
    tag, image_id = busybox_image
    rank0_cache, worker_cache = docker_pair
    outcome = stream_real(rank0_cache, worker_cache, tag, make_jobs(2))

    assert outcome["rank0"]["action_taken"] == "streamed", outcome
    assert outcome["worker"]["action_taken"] == "streamed", outcome
    assert worker_dockerd.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip() == image_id
    key = image_id.split(":", 1)[1]
    streamed_tar = os.path.join(rank0_cache.root, key + ".tar")
    published_dir = tmp_path / "published"
    published_dir.mkdir(mode=0o700)
    ImageCache(str(published_dir), docker_host=private_dockerd.host).publish(tag)

    def sha(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()

    assert sha(streamed_tar) == sha(published_dir / (key + ".tar"))
    assert rank0_cache.read_marker(key)["sha256"] == sha(streamed_tar)


def test_an_image_whose_cache_entry_is_layered_is_streamed_from_a_save(docker_pair, worker_dockerd, busybox_image):
    tag, image_id = busybox_image
    rank0_cache, worker_cache = docker_pair
    key = image_id.split(":", 1)[1]
    # A layered entry (an earlier cache-mode job pushed only its config and layer): no tar the stream could send.
    os.makedirs(rank0_cache.blob_dir)
    layer = "sha256:" + "1" * 64
    for digest in (image_id, layer):
        open(rank0_cache.blob_path(digest), "wb").close()
    layers = [{"diff_id": "sha256:" + "2" * 64, "blob": layer}]
    with open(rank0_cache.marker_path(key), "w") as marker:
        json.dump({"format": 1, "image_id": image_id, "size": 0, "sha256": None, "layers": layers}, marker)

    outcome = stream_real(rank0_cache, worker_cache, tag, make_jobs(2))

    assert (outcome["rank0"]["action_taken"], outcome["worker"]["action_taken"]) == ("streamed", "streamed"), outcome
    assert worker_dockerd.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip() == image_id
    assert "layers" not in rank0_cache.read_marker(key)  # the whole tar's entry now, for the next stream too


def test_a_corrupted_byte_loads_nothing_into_a_real_daemon_then_the_cache_gives_the_right_image(
    docker_pair, worker_dockerd, busybox_image
):
    tag, image_id = busybox_image
    rank0_cache, worker_cache = docker_pair
    jobs = make_jobs(2)
    proxy_address = "127.0.0.122"
    worker = StreamJob(TOKEN, "4242", 1, jobs[0].hosts, [proxy_address, "127.0.0.102"], jobs[0].ports, 1, 10.0, 5.0)
    CorruptingProxy(proxy_address, (jobs[0].addresses[0], jobs[0].ports[0]), offset=300_000)
    seen = {}

    real_load = image_stream.HeldBackLoad

    def open_load():
        seen["load"] = real_load(worker_cache.docker_timeout, worker_cache.docker_host)
        return seen["load"]

    outcome = stream_real(rank0_cache, worker_cache, tag, [jobs[0], worker], open_load=open_load)

    result = outcome["worker"]
    assert result["action_taken"] == "loaded-from-cache", outcome
    assert "does not match its trailer" in result["stream_error"] and "rank 1 (node2)" in result["stream_error"]
    assert seen["load"].size > 300_000  # the corrupted stream did reach docker load, all but its tail
    assert worker_dockerd.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip() == image_id


def test_a_corrupted_stream_alone_leaves_no_image_on_a_real_daemon(docker_pair, worker_dockerd, busybox_image):
    """The same corruption without a cache entry to fall back on: the daemon must not hold the image."""
    tag, image_id = busybox_image
    rank0_cache, worker_cache = docker_pair
    jobs = make_jobs(2)
    proxy_address = "127.0.0.123"
    worker = StreamJob(TOKEN, "4242", 1, jobs[0].hosts, [proxy_address, "127.0.0.102"], jobs[0].ports, 1, 10.0, 5.0)
    CorruptingProxy(proxy_address, (jobs[0].addresses[0], jobs[0].ports[0]), offset=300_000)
    outcome = {}

    def work():
        try:
            outcome["worker"] = receive_image(worker_cache, worker, image=tag, fallback_wait=0.0)
        except Exception as error:  # noqa: BLE001
            outcome["worker"] = error

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    # Rank 0's side streams bytes only (no cache entry is written), with the module's parts.
    payload = rank0_cache.inspect(tag) and _saved(rank0_cache, tag)
    serve(jobs[0], payload)
    thread.join(60)
    assert isinstance(outcome["worker"], ImageCacheError), outcome
    images = worker_dockerd.docker("images", "-a", "-q", "--no-trunc").stdout.split()
    assert image_id not in images


def _saved(cache, tag):
    import subprocess

    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import docker_argv

    return subprocess.run(docker_argv(["save", tag], cache.docker_host), capture_output=True, check=True).stdout


def test_a_child_gone_before_its_want_is_not_waited_for(tmp_path, payload):
    """Rank 2 fails before it tells rank 1 whether it needs the image (its docker down): rank 1 and rank 0 go on
    at once instead of waiting out the setup timeout."""
    jobs = make_jobs(3, setup_timeout=20.0)

    class DaemonDown(MemoryDaemon):
        def image_id_of(self, ref):
            raise image_stream.DockerError(["docker", "image", "inspect"], "Cannot connect to the Docker daemon")

    daemons = [MemoryDaemon(tmp_path, payload), MemoryDaemon(tmp_path, payload), DaemonDown(tmp_path, payload)]
    started = time.monotonic()
    outcomes, threads = run_receivers(jobs, daemons, tmp_path)
    serve(jobs[0], payload)
    join_all(threads)
    assert time.monotonic() - started < 10
    assert outcomes[1]["action_taken"] == "streamed"
    assert isinstance(outcomes[2], image_stream.DockerError)


def test_a_local_peer_joining_in_a_childs_name_and_hanging_up_changes_nothing(tmp_path, payload):
    """Someone on the node, without the token, sends a well-formed JOIN for rank 1 and hangs up: rank 0 still
    waits for the real rank 1, which then gets the stream, instead of giving it up and making it fall back."""
    jobs = make_jobs(2, setup_timeout=20.0)
    listener = listen(jobs[0].addresses[0], jobs[0].ports)
    admission, admitted, _ = admit_in_background(jobs[0], listener)
    with socket.create_connection((jobs[0].addresses[0], listener.getsockname()[1])) as stray:
        stray.sendall(format_join_line(1, "node2", new_nonce()))
    outcomes, threads = run_receivers(jobs, [MemoryDaemon(tmp_path, payload) for _ in range(2)], tmp_path)
    admission.join(30)
    listener.close()
    assert list(admitted) == [1]  # the real rank 1, admitted after the stray
    stream_to(jobs[0], admitted, payload)
    join_all(threads)
    assert outcomes[1]["action_taken"] == "streamed"


def stream_to(job, admitted, payload):
    """Rank 0's part after admit_children: the payload and its trailer to the children admitted."""
    fanout = Fanout(job.token, admitted, job.io_timeout)
    fanout.release_unneeded()
    for offset in range(0, len(payload), 65536):
        fanout.data(payload[offset : offset + 65536])
    fanout.end(len(payload), hashlib.sha256(payload).hexdigest())
    fanout.close()


def admit_in_background(job, listener, seconds=20):
    """admit_children in a thread: (the thread, what it admitted, when it returned)."""
    admitted, returned = {}, []

    def admit():
        admitted.update(admit_children(listener, job, IMAGE_ID, 0, time.monotonic() + seconds))
        returned.append(time.monotonic())

    admission = threading.Thread(target=admit, daemon=True)
    admission.start()
    return admission, admitted, returned


def idle_connections(address, port, count):
    """`count` connections that never send a byte (someone without the token, holding sockets open). A pause every
    32 lets the admitting thread have the GIL: else this loop fills the listener's backlog of 64 faster than any
    accept, and the kernel's SYN retries make the flood itself take seconds."""
    socks = []
    for number in range(count):
        socks.append(socket.create_connection((address, port)))
        if number % 32 == 31:
            time.sleep(0.005)
    return socks


def closed_by_peer(socks, enough, seconds):
    """How many of `socks` the other side has closed (EOF or reset), counted until `enough` are or `seconds` passed."""
    pending, closed = set(socks), 0
    until = time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        for sock in pending:
            selector.register(sock, selectors.EVENT_READ)
        while closed < enough and time.monotonic() < until:
            for key, _ in selector.select(max(0.0, until - time.monotonic())):
                try:
                    ended = key.fileobj.recv(1) == b""
                except ConnectionResetError:
                    ended = True
                if ended:
                    selector.unregister(key.fileobj)
                    pending.discard(key.fileobj)
                    closed += 1
    return closed


def the_honest_child_joins_at_once(jobs, listener, admission, tmp_path, payload):
    """Rank 1 comes now, past whatever holds rank 0's port: it is admitted within 2 s and gets the stream."""
    started = time.monotonic()
    outcomes, threads = run_receivers(jobs, [MemoryDaemon(tmp_path, payload) for _ in range(2)], tmp_path)
    thread, admitted, returned = admission
    thread.join(30)
    listener.close()
    assert list(admitted) == [1]
    assert returned[0] - started < 2.0, f"the child was admitted {returned[0] - started:.1f} s after it came"
    stream_to(jobs[0], admitted, payload)
    join_all(threads)
    assert outcomes[1]["action_taken"] == "streamed"


def test_idle_connections_that_never_join_keep_no_child_out(tmp_path, payload):
    """Four connections that never send JOIN (as many as a parent once greeted per child): the honest child,
    coming after them, is admitted at once and gets the stream, instead of being reset until they time out."""
    jobs = make_jobs(2, setup_timeout=20.0)
    listener = listen(jobs[0].addresses[0], jobs[0].ports)
    admission = admit_in_background(jobs[0], listener)
    idle = idle_connections(jobs[0].addresses[0], listener.getsockname()[1], 4)
    time.sleep(0.5)  # accepted and being greeted
    the_honest_child_joins_at_once(jobs, listener, admission, tmp_path, payload)
    for sock in idle:
        sock.close()


def test_a_flood_of_idle_connections_takes_no_thread_each_and_keeps_no_child_out(tmp_path, payload):
    """Hundreds of connections that never JOIN: the parent keeps only a bounded few open (the oldest closed for
    each new one), starts no thread for any of them, and the honest child still joins at once."""
    jobs = make_jobs(2, setup_timeout=20.0)
    listener = listen(jobs[0].addresses[0], jobs[0].ports)
    threads_before = threading.active_count()
    admission = admit_in_background(jobs[0], listener)
    flood = idle_connections(jobs[0].addresses[0], listener.getsockname()[1], 400)
    evicted = 400 - stream_protocol.MAX_UNJOINED_CONNECTIONS
    assert closed_by_peer(flood, evicted, 3.0) == evicted
    assert threading.active_count() <= threads_before + 1  # the admission thread alone
    the_honest_child_joins_at_once(jobs, listener, admission, tmp_path, payload)
    for sock in flood:
        sock.close()


# Rank 0's heartbeat: a worker whose stream broke waits for the cache entry only while rank 0 is alive.

KEY = "cd" * 32


def commit_marker(cache):
    # By rename, as a real commit is: a marker written in place can be read empty by the waiting worker.
    path = cache.marker_path(KEY)
    with open(path + ".tmp", "w") as handle:
        json.dump({"image_id": "sha256:" + KEY, "size": 1, "sha256": "00" * 32}, handle)
    os.replace(path + ".tmp", path)


def test_a_worker_waits_while_rank0_beats_and_takes_the_entry_it_commits(tmp_path):
    cache = CacheDirectory(str(tmp_path / "cache"))
    with PublisherHeartbeat(cache, KEY, interval=0.1) as heartbeat:
        threading.Timer(1.5, commit_marker, (cache,)).start()
        started = time.monotonic()
        wait_for_rank0_entry(cache, KEY, wait=30, rank0="rank 0 (node1)", stale_after=0.5)
        assert 1.4 < time.monotonic() - started < 10  # beyond stale_after: the beats kept it waiting
    assert not os.path.exists(heartbeat.path)


def test_a_worker_gives_up_at_once_when_rank0s_heartbeat_stands_still(tmp_path):
    cache = CacheDirectory(str(tmp_path / "cache"))
    beat = PublisherHeartbeat(cache, KEY, interval=0.1).__enter__()
    beat._stop.set()  # rank 0 killed: the file stays, nobody rewrites it
    started = time.monotonic()
    with pytest.raises(StreamError, match=r"rank 0 \(node1\) died while writing .* stood still for 0.5 s"):
        wait_for_rank0_entry(cache, KEY, wait=60, rank0="rank 0 (node1)", stale_after=0.5)
    assert time.monotonic() - started < 10


def test_a_worker_gives_up_when_rank0_ends_without_committing(tmp_path):
    cache = CacheDirectory(str(tmp_path / "cache"))
    heartbeat = PublisherHeartbeat(cache, KEY, interval=0.1).__enter__()
    threading.Timer(0.5, heartbeat.__exit__, (None, None, None)).start()
    with pytest.raises(StreamError, match=r"rank 0 \(node1\) ended without committing"):
        wait_for_rank0_entry(cache, KEY, wait=60, rank0="rank 0 (node1)", stale_after=30)


def test_without_any_heartbeat_a_worker_waits_the_whole_fallback_wait(tmp_path):
    # A shared filesystem that shows the heartbeat late (or an older rank 0): the plain wait, as before.
    cache = CacheDirectory(str(tmp_path / "cache"))
    os.makedirs(cache.root)
    started = time.monotonic()
    wait_for_rank0_entry(cache, KEY, wait=1.0, rank0="rank 0 (node1)", stale_after=0.2)
    assert time.monotonic() - started >= 1.0


# -- paths the suite reached only by a race (issue 27's coverage comparison): driven on purpose -------------------


def test_a_hello_under_another_token_fails_authentication():
    session = Session("4242", 1, "node2", new_nonce(), new_nonce())
    hello = stream_protocol.format_hello("another-token", session, "sha256:" + "a" * 64, 1000)
    with pytest.raises(ProtocolViolation, match="HELLO failed authentication"):
        stream_protocol.parse_hello(hello.rstrip(b"\n"), TOKEN, "4242", 1, "node2", session.worker_nonce)
    good = stream_protocol.format_hello(TOKEN, session, "sha256:" + "a" * 64, 1000)
    assert stream_protocol.parse_hello(good.rstrip(b"\n"), TOKEN, "4242", 1, "node2", session.worker_nonce)[1:] == (
        "sha256:" + "a" * 64,
        1000,
    )


def test_a_node_listens_on_the_next_candidate_port_and_names_every_taken_one():
    taken = socket.create_server(("127.0.0.1", 0))
    busy = taken.getsockname()[1]
    try:
        free = socket.create_server(("127.0.0.1", 0))
        spare = free.getsockname()[1]
        free.close()
        listener = stream_protocol.listen("127.0.0.1", [busy, spare])
        assert listener.getsockname()[1] == spare
        listener.close()
        refused = rf"cannot listen on 127.0.0.1 at any of the ports {busy}: "
        with pytest.raises(stream_protocol.StreamError, match=refused):
            stream_protocol.listen("127.0.0.1", [busy])
    finally:
        taken.close()


def test_a_worker_refuses_a_parent_whose_hello_fails_authentication_and_says_so():
    # Another job's sender on the parent's port: it greets every JOIN with a HELLO under its own token.
    rank0, worker = make_jobs(2)
    stranger = socket.create_server((rank0.addresses[0], rank0.ports[0]))

    def greet():
        while True:
            try:
                conn, _ = stranger.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                conn.makefile("rb").readline()
                session = Session("4242", 1, "node2", new_nonce(), new_nonce())
                conn.sendall(stream_protocol.format_hello("another-token", session, "sha256:" + "a" * 64, 1))

    threading.Thread(target=greet, daemon=True).start()
    try:
        with pytest.raises(stream_protocol.StreamBroken, match="refused: HELLO failed authentication"):
            stream_protocol.join_parent(worker, time.monotonic() + 1.5)
    finally:
        stranger.close()
