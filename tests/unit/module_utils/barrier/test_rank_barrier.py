"""The rank-0 image-ready barrier, over real sockets on loopback: rank 0 in a thread, workers in threads or raw."""

import contextlib
import logging
import multiprocessing
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.errors import (
    BarrierAborted,
    BarrierConfigError,
    BarrierError,
    BarrierTimeout,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.protocol import (
    ReadyMessage,
    Release,
    format_abort_line,
    format_go_line,
    format_hello_line,
    format_ready_line,
    parse_hello_line,
    parse_ready_line,
    parse_release_line,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.server import RankBarrierServer
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import (
    MAX_LINE_BYTES,
    ProtocolViolation,
    Session,
    derive_barrier_ports,
    format_join_line,
    message_mac,
    new_nonce,
    parse_join_line,
    parse_port_range,
    raise_open_files_limit,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.worker import join_rank_barrier
from tests.support.users.barrier_impostor import BarrierImpostor, read_line, read_until_closed

ADDRESS = "127.0.0.1"
TOKEN = "s3cret-Barrier-Token-42"
JOB = "4242"
IMAGE = "sha256:" + "a" * 64
OTHER_IMAGE = "sha256:" + "b" * 64


def free_port(address=ADDRESS):
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def a_session(rank=1, job_id=JOB, hostname="node2"):
    return Session(job_id, rank, hostname, new_nonce(), new_nonce())


class RawWorker:
    """A hand-driven worker connection, for what the real worker never sends: JOIN sent, rank 0's HELLO checked."""

    def __init__(self, port, rank=1, hostname="node2", address=ADDRESS):
        self.sock = socket.create_connection((address, port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = new_nonce()
        self.sock.sendall(format_join_line(rank, hostname, nonce))
        self.session = parse_hello_line(read_line(self.sock)[:-1], TOKEN, JOB, rank, hostname, nonce)

    def ready(self, image_id=IMAGE, token=TOKEN):
        return format_ready_line(token, self.session, image_id)

    def release(self):
        """Rank 0's authenticated answer on this connection."""
        return parse_release_line(read_line(self.sock)[:-1], TOKEN, self.session)

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.sock.close()


def bare_connection(port, address=ADDRESS):
    """A connection that has sent nothing yet."""
    return socket.create_connection((address, port), timeout=5)


def wait_for_arrival(server, rank):
    """Block until rank 0 accepted `rank`'s READY (the protocol does not acknowledge it): poll with a deadline."""
    deadline = time.monotonic() + 5
    while rank not in server.arrived_ranks:
        assert time.monotonic() < deadline, f"rank {rank} never arrived"
        time.sleep(0.005)


@pytest.fixture
def pool():
    executor = ThreadPoolExecutor(max_workers=8)
    yield executor
    executor.shutdown(wait=True)


@pytest.fixture
def start_rank0(pool):
    """start_rank0(nnodes, ...) -> (server, future of serve()); rank 0 already listens when it returns."""
    servers = []

    def start(
        nnodes,
        image_id=IMAGE,
        hosts=None,
        timeout=5.0,
        idle_timeout=5.0,
        ports=None,
        address=ADDRESS,
        token=TOKEN,
        job_id=JOB,
    ):
        server = RankBarrierServer(
            address, ports or [free_port(address)], nnodes, image_id, token, hosts, idle_timeout, job_id=job_id
        )
        servers.append(server)
        server.listen()
        return server, pool.submit(server.serve, timeout)

    yield start
    for server in servers:
        server.close()


def join(ports, rank, nnodes, image_id=IMAGE, timeout=5.0, token=TOKEN, job_id=JOB, **options):
    options.setdefault("hostname", f"node{rank + 1}")
    return join_rank_barrier(ADDRESS, ports, rank, nnodes, token, image_id, timeout, job_id=job_id, **options)


# ------------------------------------------------------------------------------------------------------ the ports


def test_ports_are_the_same_for_the_same_job_on_every_node():
    assert derive_barrier_ports(29500, "4242") == derive_barrier_ports(29500, "4242")


def test_ports_differ_between_jobs():
    assert derive_barrier_ports(29500, "4242") != derive_barrier_ports(29500, "4243")


def test_ports_differ_between_master_ports_of_the_same_job():
    assert derive_barrier_ports(29500, "4242") != derive_barrier_ports(29501, "4242")


def test_ports_are_distinct_candidates_inside_the_configured_range():
    for job_id in range(500):
        ports = derive_barrier_ports(12345, job_id, (30000, 30099), 3)
        assert len(set(ports)) == 3
        assert all(30000 <= port <= 30099 for port in ports)


def test_ports_default_to_three_candidates_in_20000_29999():
    ports = derive_barrier_ports(29500, "1")
    assert len(ports) == 3 and all(20000 <= port <= 29999 for port in ports)


def test_ports_never_include_master_port():
    for job_id in range(300):
        assert 40005 not in derive_barrier_ports(40005, job_id, (40000, 40009), 5)


def test_port_range_parses_low_dash_high():
    assert parse_port_range(" 20000 - 29999 ") == (20000, 29999)


@pytest.mark.parametrize("bad", ["29999-20000", "80-90", "20000-70000", "20000", "a-b", "", [1, 2, 3]])
def test_port_range_refuses_what_cannot_be_bound(bad):
    with pytest.raises(BarrierConfigError, match="port_range must be LOW-HIGH"):
        parse_port_range(bad)


def test_port_candidates_must_fit_the_range():
    with pytest.raises(BarrierConfigError, match="port_candidates"):
        derive_barrier_ports(29500, "1", (20000, 20002), 3)


# ---------------------------------------------------------------------------------------------------- the protocol


def test_nonces_are_fresh_hex():
    nonces = {new_nonce() for _ in range(1000)}
    assert len(nonces) == 1000 and all(len(nonce) == 32 and int(nonce, 16) >= 0 for nonce in nonces)


def test_a_mac_covers_its_type_the_job_the_rank_the_host_both_nonces_and_the_fields():
    session = a_session()
    mac = message_mac(TOKEN, "READY", session, IMAGE)
    nonces = session.rank0_nonce, session.worker_nonce
    variants = [
        message_mac("another-token", "READY", session, IMAGE),
        message_mac(TOKEN, "GO", session, IMAGE),
        message_mac(TOKEN, "READY", Session("4243", 1, "node2", *nonces), IMAGE),
        message_mac(TOKEN, "READY", Session(JOB, 2, "node2", *nonces), IMAGE),
        message_mac(TOKEN, "READY", Session(JOB, 1, "node9", *nonces), IMAGE),
        message_mac(TOKEN, "READY", Session(JOB, 1, "node2", new_nonce(), session.worker_nonce), IMAGE),
        message_mac(TOKEN, "READY", Session(JOB, 1, "node2", session.rank0_nonce, new_nonce()), IMAGE),
        message_mac(TOKEN, "READY", session, OTHER_IMAGE),
        message_mac(TOKEN, "READY", Session(JOB, 1, "node2" + IMAGE[:1], *nonces), IMAGE[1:]),  # no sliding
    ]
    assert len(mac) == 64 and mac not in variants and len(set(variants)) == len(variants)


def test_no_line_of_either_side_carries_the_token():
    session = a_session()
    lines = [
        format_join_line(1, "node2", session.worker_nonce),
        format_hello_line(TOKEN, session),
        format_ready_line(TOKEN, session, IMAGE),
        format_go_line(TOKEN, session, IMAGE),
        format_abort_line(TOKEN, session, "rank 0 gave up"),
    ]
    assert not any(TOKEN.encode() in line for line in lines), lines


def test_the_longest_fields_fit_in_a_line():
    session = Session(JOB, 999999999, "h" * 255, new_nonce(), new_nonce())
    lines = [
        format_join_line(session.rank, session.hostname, session.worker_nonce),
        format_ready_line(TOKEN, session, "i" * 255),
        format_go_line(TOKEN, session, "i" * 255),
    ]
    assert max(len(line) for line in lines) <= MAX_LINE_BYTES


def test_join_line_round_trips():
    nonce = new_nonce()
    assert parse_join_line(format_join_line(3, "node4", nonce)[:-1], 4) == (3, "node4", nonce)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("JOIN 0 node1 {nonce}", "out of range"),
        ("JOIN 4 node5 {nonce}", "out of range"),
        ("JOIN -1 node2 {nonce}", "not a plain decimal integer"),
        ("JOIN +1 node2 {nonce}", "not a plain decimal integer"),
        ("JOIN 1_0 node2 {nonce}", "not a plain decimal integer"),
        ("JOIN 01 node2 {nonce}", "not a plain decimal integer"),
        ("JOIN one node2 {nonce}", "not a plain decimal integer"),
        ("JOIN  1 node2 {nonce}", "5 space-separated fields"),
        ("JOIN 1 {nonce}", "3 space-separated fields"),
        ("JOIN 1 node\x7f {nonce}", "non-printable hostname"),
        ("JOIN 1 node2 {short}", "nonce is not 32 lowercase hex"),
        ("JOIN 1 node2 {upper}", "nonce is not 32 lowercase hex"),
        ("JOIN 1 node2 {nonce}\r", "nonce is not 32 lowercase hex"),
        (f"READY {TOKEN} 1 node2 {IMAGE}", "not a JOIN line"),  # the previous protocol's clear-text token
        ("GET / HTTP/1.1", "not a JOIN line"),
    ],
)
def test_join_line_is_parsed_strictly(line, reason):
    nonce = new_nonce()
    text = line.format(nonce=nonce, short=nonce[:-2], upper=nonce.upper().replace("0", "A").replace("1", "B"))
    with pytest.raises(ProtocolViolation, match=reason):
        parse_join_line(text.encode(), 4)


def test_non_ascii_line_is_garbage():
    with pytest.raises(ProtocolViolation, match="garbage"):
        parse_join_line(b"JOIN \xff\xfe 1", 4)


def test_ready_line_round_trips():
    session = a_session(rank=3)
    line = format_ready_line(TOKEN, session, IMAGE)
    assert line.endswith(b"\n")
    assert parse_ready_line(line[:-1], TOKEN, session) == ReadyMessage(3, "node2", IMAGE)


def test_ready_under_another_token_fails_authentication():
    session = a_session()
    with pytest.raises(ProtocolViolation, match="READY failed authentication"):
        parse_ready_line(format_ready_line("a-guess", session, IMAGE)[:-1], TOKEN, session)


def test_ready_from_another_connection_fails_authentication():
    captured = format_ready_line(TOKEN, a_session(), IMAGE)
    with pytest.raises(ProtocolViolation, match="READY failed authentication"):
        parse_ready_line(captured[:-1], TOKEN, a_session())


def test_ready_with_its_image_changed_fails_authentication():
    session = a_session()
    tampered = format_ready_line(TOKEN, session, IMAGE).replace(IMAGE.encode(), OTHER_IMAGE.encode())
    with pytest.raises(ProtocolViolation, match="READY failed authentication"):
        parse_ready_line(tampered[:-1], TOKEN, session)


def test_ready_from_another_host_claiming_the_same_rank_fails_authentication():
    session = a_session()
    other_host = Session(JOB, 1, "node9", session.rank0_nonce, session.worker_nonce)
    with pytest.raises(ProtocolViolation, match="READY failed authentication"):
        parse_ready_line(format_ready_line(TOKEN, other_host, IMAGE)[:-1], TOKEN, session)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("READY {image}", "2 space-separated fields"),
        ("READY  {image} {mac}", "4 space-separated fields"),
        ("READY {image} {short_mac}", "failed authentication"),
        ("WAIT", "not a READY line"),
    ],
)
def test_ready_line_is_parsed_strictly(line, reason):
    session = a_session()
    mac = message_mac(TOKEN, "READY", session, IMAGE)
    text = line.format(image=IMAGE, mac=mac, short_mac=mac[:-1])
    with pytest.raises(ProtocolViolation, match=reason):
        parse_ready_line(text.encode(), TOKEN, session)


def test_hello_round_trips_into_the_connections_session():
    session = a_session(rank=2)
    line = format_hello_line(TOKEN, session)
    assert parse_hello_line(line[:-1], TOKEN, JOB, 2, "node2", session.worker_nonce) == session


@pytest.mark.parametrize("what", ["token", "job", "rank", "hostname", "worker nonce"])
def test_hello_for_another_token_job_rank_host_or_connection_fails_authentication(what):
    session = a_session(rank=2)
    token, job, rank, hostname, nonce = TOKEN, JOB, 2, "node2", session.worker_nonce
    if what == "token":
        token = "another-jobs-token"
    elif what == "job":
        job = "4243"
    elif what == "rank":
        rank = 1
    elif what == "hostname":
        hostname = "node9"
    else:
        nonce = new_nonce()
    with pytest.raises(ProtocolViolation, match="HELLO failed authentication"):
        parse_hello_line(format_hello_line(TOKEN, session)[:-1], token, job, rank, hostname, nonce)


@pytest.mark.parametrize("line", [b"HELLO", b"HELLO abc def", b"SSH-2.0-OpenSSH_9.2\r"])
def test_a_greeting_that_is_not_a_hello_is_refused(line):
    with pytest.raises(ProtocolViolation):
        parse_hello_line(line, TOKEN, JOB, 1, "node2", new_nonce())


def test_go_and_abort_round_trip():
    session = a_session()
    assert parse_release_line(format_go_line(TOKEN, session, IMAGE)[:-1], TOKEN, session) == Release(True, IMAGE)
    abort = format_abort_line(TOKEN, session, "node node3 (rank 2) has image x")[:-1]
    assert parse_release_line(abort, TOKEN, session) == Release(False, reason="node node3 (rank 2) has image x")


@pytest.mark.parametrize(
    "forge",
    [
        lambda session: format_go_line("a-guess", session, IMAGE),
        lambda session: format_go_line(TOKEN, a_session(), IMAGE),  # a GO of another connection
        lambda session: format_go_line(TOKEN, session, IMAGE).replace(b"a" * 64, b"b" * 64, 1),  # tampered image
        lambda session: format_abort_line("a-guess", session, "rank 0 gave up"),
        lambda session: format_abort_line(TOKEN, session, "rank 0 gave up").replace(b"gave up", b"is done"),
        lambda session: format_hello_line(TOKEN, session).replace(
            b"HELLO " + session.rank0_nonce.encode(), b"GO " + IMAGE.encode()
        ),  # HELLO's MAC as GO's
        lambda session: b"GO\n",  # the previous protocol's
        lambda session: b"ABORT rank 0 gave up after 600 s\n",
    ],
)
def test_an_unauthenticated_go_or_abort_is_refused(forge):
    session = a_session()
    with pytest.raises(ProtocolViolation):
        parse_release_line(forge(session)[:-1], TOKEN, session)


def test_abort_reason_is_cut_to_the_line_bound_and_stays_authentic():
    session = a_session()
    line = format_abort_line(TOKEN, session, "missing ranks " + "1 (gpu001), " * 100 + "\n\x00é")
    assert len(line) == MAX_LINE_BYTES and line.count(b"\n") == 1
    assert parse_release_line(line[:-1], TOKEN, session).reason.startswith("missing ranks 1 (gpu001), ")


def test_rejection_reasons_never_quote_the_token():
    session = a_session()
    near_miss = TOKEN + "x"
    with pytest.raises(ProtocolViolation) as caught:
        parse_ready_line(format_ready_line(near_miss, session, IMAGE)[:-1], TOKEN, session)
    assert TOKEN not in str(caught.value)


def test_a_token_the_protocol_cannot_carry_is_refused_without_quoting_it():
    with pytest.raises(BarrierConfigError) as caught:
        join([free_port()], 1, 2, token="two words")
    assert "two words" not in str(caught.value)


def test_a_hostname_the_protocol_cannot_carry_is_refused_before_connecting():
    with pytest.raises(BarrierConfigError, match="hostname must be 1-255 printable ASCII"):
        join([free_port()], 1, 2, hostname="n" * 256)


# ------------------------------------------------------------------------------------------------- the release


def test_rank0_releases_when_every_worker_arrived_with_the_announced_image(start_rank0, pool):
    server, served = start_rank0(nnodes=4)
    workers = [pool.submit(join, [server.port], rank, 4) for rank in (1, 2, 3)]
    result = served.result()
    assert [worker.result().port for worker in workers] == [server.port] * 3
    assert [(w["rank"], w["hostname"]) for w in result.workers] == [(1, "node2"), (2, "node3"), (3, "node4")]
    assert result.port == server.port and result.rejections == []
    assert [worker.result().rejections for worker in workers] == [[], [], []]


def test_single_node_run_releases_at_once_without_listening():
    with RankBarrierServer(ADDRESS, [free_port()], 1, IMAGE, TOKEN, job_id=JOB) as server:
        result = server.serve(timeout=5)
    assert result.port is None and result.workers == []


def test_rank0_listens_only_on_master_addr(start_rank0, pool):
    server, served = start_rank0(nnodes=2, address="127.0.0.2")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    join_rank_barrier("127.0.0.2", [server.port], 1, 2, TOKEN, IMAGE, timeout=5, hostname="node2", job_id=JOB)
    assert served.result().workers[0]["rank"] == 1


def test_rank0_binds_the_next_candidate_when_the_first_is_taken():
    with socket.create_server((ADDRESS, 0)) as occupant:
        taken, free = occupant.getsockname()[1], free_port()
        with RankBarrierServer(ADDRESS, [taken, free], 2, IMAGE, TOKEN, job_id=JOB) as server:
            assert server.listen() == free


def test_rank0_fails_naming_the_ports_when_every_candidate_is_taken():
    with socket.create_server((ADDRESS, 0)) as occupant:
        taken = occupant.getsockname()[1]
        with RankBarrierServer(ADDRESS, [taken], 2, IMAGE, TOKEN, job_id=JOB) as server:
            with pytest.raises(BarrierError, match=f"in use \\({taken}\\)"):
                server.listen()


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_rank0_refuses_to_listen_on_every_interface(address):
    with pytest.raises(BarrierConfigError, match="every interface"):
        RankBarrierServer(address, [free_port()], 2, IMAGE, TOKEN, job_id=JOB)


def test_master_addr_must_be_an_ip_address():
    with pytest.raises(BarrierConfigError, match="must be an IP address"):
        RankBarrierServer("node1", [free_port()], 2, IMAGE, TOKEN, job_id=JOB)


def test_hosts_must_name_every_rank():
    with pytest.raises(BarrierConfigError, match="3 names for nnodes=3"):
        RankBarrierServer(ADDRESS, [free_port()], 3, IMAGE, TOKEN, hosts=["node1", "node2"], job_id=JOB)


def test_job_id_must_be_given():
    with pytest.raises(BarrierConfigError, match="job_id must be a non-empty string"):
        RankBarrierServer(ADDRESS, [free_port()], 2, IMAGE, TOKEN, job_id="")


@pytest.mark.parametrize("rank", [0, 3, -1])
def test_a_worker_rank_must_be_between_1_and_nnodes_minus_1(rank):
    with pytest.raises(BarrierConfigError, match="from 1 to nnodes-1=2"):
        join([free_port()], rank, 3)


def test_handles_over_a_thousand_concurrent_workers(start_rank0):
    workers = 1100
    if raise_open_files_limit(2 * workers + 256) < 2 * workers + 256:
        pytest.skip("the hard open files limit is too low for 2200 loopback sockets")
    server, served = start_rank0(nnodes=workers + 1)
    connections = []
    try:
        for rank in range(1, workers + 1):
            connection = RawWorker(server.port, rank, f"node{rank + 1}")
            connection.sendall(connection.ready())
            connections.append(connection)
        assert len(served.result().workers) == workers
        assert {connection.release() for connection in connections} == {Release(True, IMAGE)}
    finally:
        for connection in connections:
            connection.close()


# --------------------------------------------------------------------------------------------------- the workers


def test_worker_started_before_rank0_listens_joins_once_it_does(pool):
    port = free_port()
    attempts = []
    first_attempt_failed = threading.Event()

    def count_attempts():
        attempts.append(time.monotonic())
        if len(attempts) == 2:  # called before each attempt: the first one is over
            first_attempt_failed.set()

    worker = pool.submit(join, [port], 1, 2, abort_check=count_attempts)
    assert first_attempt_failed.wait(5), "the worker never tried to connect"
    with RankBarrierServer(ADDRESS, [port], 2, IMAGE, TOKEN, job_id=JOB) as server:
        server.serve(timeout=5)
    assert worker.result().port == port


def test_worker_times_out_naming_what_each_port_answered_when_rank0_never_listens():
    port = free_port()
    with pytest.raises(BarrierTimeout, match=f"rank 1 got no GO from rank 0 at {ADDRESS} .*port {port}: .*refused"):
        join([port], 1, 2, timeout=0.5)


def test_worker_moves_past_a_silent_listener_on_the_first_candidate(start_rank0):
    with socket.create_server((ADDRESS, 0)) as silent:  # accepts in the kernel, never answers
        server, served = start_rank0(nnodes=2)
        result = join([silent.getsockname()[1], server.port], 1, 2, reply_timeout=0.3)
    assert result.port == server.port
    assert served.result().workers[0]["rank"] == 1


def test_a_foreign_service_on_a_candidate_port_hears_only_the_join_line(start_rank0, pool):
    with socket.create_server((ADDRESS, 0)) as foreign:  # another service: greets in its own protocol

        def foreign_service():
            connection, _ = foreign.accept()
            with connection:
                connection.settimeout(2)
                connection.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
                return read_until_closed(connection)

        heard = pool.submit(foreign_service)
        server, served = start_rank0(nnodes=2)
        result = join([foreign.getsockname()[1], server.port], 1, 2)
        line = heard.result(timeout=5)
    assert line.startswith(b"JOIN 1 ") and line.count(b"\n") == 1 and TOKEN.encode() not in line
    assert result.port == server.port
    assert served.result().workers[0]["rank"] == 1
    assert result.rejections[0]["reason"] == "greeting refused: garbage: not a HELLO line"


def test_worker_moves_past_another_jobs_barrier_on_a_colliding_port(start_rank0, pool):
    with RankBarrierServer(ADDRESS, [free_port()], 2, IMAGE, "another-jobs-token", job_id="4243") as other_job:
        other_job.listen()
        other_served = pool.submit(other_job.serve, 2.0)
        server, served = start_rank0(nnodes=2)
        result = join([other_job.port, server.port], 1, 2)
        assert result.port == server.port
        with pytest.raises(BarrierTimeout):
            other_served.result()
    # The worker refused the other barrier's greeting: it never sent READY there.
    assert [rejection["reason"] for rejection in other_job.rejections] == ["closed without sending READY"]
    assert "HELLO failed authentication" in result.rejections[0]["reason"]


def test_a_worker_of_another_job_sharing_the_token_never_joins(start_rank0):
    server, served = start_rank0(nnodes=2, timeout=1.0)
    with pytest.raises(BarrierTimeout, match="HELLO failed authentication"):
        join([server.port], 1, 2, job_id="4243", timeout=0.5)
    with pytest.raises(BarrierTimeout, match="missing ranks 1"):
        served.result()


def test_abort_check_stops_a_worker_long_before_its_deadline():
    calls = []

    def run_given_up():
        calls.append(time.monotonic())
        return "rank 0 (node1) gave up: every barrier port candidate is in use" if len(calls) > 2 else None

    started = time.monotonic()
    expected = "rank 1 waited at the barrier: rank 0 \\(node1\\) gave up: every"
    with pytest.raises(BarrierAborted, match=expected) as caught:
        join([free_port()], 1, 2, timeout=60, abort_check=run_given_up)
    assert time.monotonic() - started < 5
    assert caught.value.reason.startswith("rank 0 (node1) gave up")


def test_rank0_reports_when_each_worker_arrived(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    first = pool.submit(join, [server.port], 1, 3)
    wait_for_arrival(server, 1)
    time.sleep(0.2)  # not synchronisation: the gap between the two arrivals that the report must show
    join([server.port], 2, 3)
    first.result()
    early, late = served.result().workers
    assert 0 <= early["arrived_seconds"] and late["arrived_seconds"] - early["arrived_seconds"] >= 0.2


def fake_rank0(pool, send_after_ready, token=TOKEN):
    """A hand-driven rank 0 holding `token` on a free port: greets byte by byte, reads READY, then runs
    send_after_ready(connection, session)."""
    listener = socket.create_server((ADDRESS, 0))

    def serve():
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(5)
                rank, hostname, worker_nonce = parse_join_line(read_line(connection)[:-1], 2)
                session = Session(JOB, rank, hostname, new_nonce(), worker_nonce)
                for byte in format_hello_line(token, session):
                    connection.sendall(bytes([byte]))
                    time.sleep(0.001)  # not synchronisation: one byte per packet
                assert read_line(connection).startswith(b"READY ")
                send_after_ready(connection, session)

    return listener.getsockname()[1], pool.submit(serve)


def test_worker_reads_replies_split_across_packets(pool):
    def go_in_pieces(connection, session):
        line = format_go_line(TOKEN, session, IMAGE)
        for piece in (line[:1], line[1:40], line[40:]):
            connection.sendall(piece)
            time.sleep(0.01)  # not synchronisation: one piece per packet

    port, served = fake_rank0(pool, go_in_pieces)
    assert join([port], 1, 2).port == port
    served.result(timeout=5)


def test_worker_greeted_but_never_released_times_out_at_its_deadline(pool):
    port, served = fake_rank0(pool, lambda connection, session: read_until_closed(connection))
    started = time.monotonic()
    with pytest.raises(BarrierTimeout, match=f"port {port}: no GO before the deadline"):
        join([port], 1, 2, timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 2
    served.result(timeout=5)


def test_a_worker_waiting_for_go_stops_once_its_abort_check_finds_rank0_lost(pool):
    """Rank 0 greeted, took READY and went silent (its process frozen, or dead on a node that drops packets): the
    worker asks its abort check while it waits for GO, not only between connection attempts."""
    lost_at = time.monotonic() + 0.5

    def rank0_lost():
        return "rank 0 (node1)'s playbook stopped its heartbeat" if time.monotonic() >= lost_at else None

    port, served = fake_rank0(pool, lambda connection, session: read_until_closed(connection))
    with pytest.raises(BarrierAborted, match="rank 1 waited at the barrier: rank 0 \\(node1\\)'s playbook") as caught:
        join([port], 1, 2, timeout=30, abort_check=rank0_lost)
    assert time.monotonic() - lost_at < 2
    assert caught.value.reason == "rank 0 (node1)'s playbook stopped its heartbeat"
    served.result(timeout=5)


def test_an_authentic_go_for_another_image_is_a_clear_failure(pool):
    port, served = fake_rank0(
        pool, lambda connection, session: connection.sendall(format_go_line(TOKEN, session, OTHER_IMAGE))
    )
    with pytest.raises(
        BarrierError,
        match=f"rank 0 released the barrier for image {OTHER_IMAGE}, but rank 1 holds "
        f"{IMAGE}: this node would run another image than rank 0",
    ):
        join([port], 1, 2)
    served.result(timeout=5)


def test_an_authentic_abort_stops_the_worker_with_rank0s_reason(pool):
    port, served = fake_rank0(
        pool,
        lambda connection, session: connection.sendall(
            format_abort_line(TOKEN, session, "rank 0 gave up after 600 s: missing ranks 2 (node3)")
        ),
    )
    with pytest.raises(BarrierAborted, match="rank 0 aborted the barrier: rank 0 gave up after 600 s") as caught:
        join([port], 1, 2, timeout=30)
    assert caught.value.reason == "rank 0 gave up after 600 s: missing ranks 2 (node3)"
    served.result(timeout=5)


def test_worker_reconnects_and_resends_ready_when_its_connection_drops_before_go(pool):
    port = free_port()
    worker = pool.submit(join, [port], 1, 2)
    with socket.create_server((ADDRESS, port)) as first_rank0:
        connection, _ = first_rank0.accept()
        with connection:
            connection.settimeout(5)
            rank, hostname, worker_nonce = parse_join_line(read_line(connection)[:-1], 2)
            connection.sendall(format_hello_line(TOKEN, Session(JOB, rank, hostname, new_nonce(), worker_nonce)))
            assert read_line(connection).startswith(b"READY ")  # then the connection breaks before GO
    with RankBarrierServer(ADDRESS, [port], 2, IMAGE, TOKEN, job_id=JOB) as server:
        result = server.serve(timeout=5)
    assert worker.result().port == port
    assert result.workers[0]["rank"] == 1


def test_image_mismatch_aborts_every_connected_worker_naming_the_node(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with RawWorker(server.port) as waiting:
        waiting.sendall(waiting.ready())
        wait_for_arrival(server, 1)
        stale = pool.submit(join, [server.port], 2, 3, image_id=OTHER_IMAGE)
        release = waiting.release()
    assert not release.go and release.reason.startswith(f"node node3 (rank 2) has image {OTHER_IMAGE}")
    with pytest.raises(BarrierAborted, match=f"node node3 \\(rank 2\\) has image {OTHER_IMAGE}, but rank 0 announced"):
        served.result()
    with pytest.raises(BarrierAborted, match="node node3 \\(rank 2\\)"):
        stale.result()


def test_rank0_stops_at_its_abort_check_and_tells_every_connected_worker(pool):
    """Pull mode: a worker that failed before the barrier leaves the ABORT marker; rank 0 must not wait it out."""
    given_up = []
    port = free_port(ADDRESS)
    with RankBarrierServer(ADDRESS, [port], 3, IMAGE, TOKEN, job_id=JOB) as server:
        server.listen()
        started = time.monotonic()
        served = pool.submit(server.serve, 30, lambda: given_up[0] if given_up else None)
        with RawWorker(port) as waiting:
            waiting.sendall(waiting.ready())
            wait_for_arrival(server, 1)
            given_up.append("rank 2 (node3) gave up: Docker on node3 is not reachable")
            release = waiting.release()
        with pytest.raises(BarrierAborted, match="rank 2 \\(node3\\) gave up: Docker on node3"):
            served.result()
    assert not release.go and "node3" in release.reason
    assert time.monotonic() - started < 10


def test_timeout_names_the_missing_ranks_and_their_hostnames(start_rank0):
    server, served = start_rank0(nnodes=4, hosts=["gpu01", "gpu02", "gpu03", "gpu04"], timeout=0.5)
    with RawWorker(server.port, hostname="gpu02") as waiting:
        waiting.sendall(waiting.ready())
        wait_for_arrival(server, 1)
        with pytest.raises(BarrierTimeout, match="missing ranks 2 \\(gpu03\\), 3 \\(gpu04\\)") as caught:
            served.result()
    assert caught.value.missing == [(2, "gpu03"), (3, "gpu04")]


def test_connected_workers_get_an_authenticated_abort_when_rank0_gives_up(start_rank0):
    server, served = start_rank0(nnodes=3, timeout=0.5)
    with RawWorker(server.port) as waiting:
        waiting.sendall(waiting.ready())
        release = waiting.release()
    assert not release.go and release.reason.startswith("rank 0 gave up after 0.5 s: missing ranks 2")
    with pytest.raises(BarrierTimeout):
        served.result()


# -------------------------------------------------------------------------------------------- the impostors


FORGED = {
    "GO under a guessed token": lambda: format_go_line("a-guess", a_session(), IMAGE),
    "the previous protocol's GO": lambda: b"GO\n",
    "ABORT under a guessed token": lambda: format_abort_line("a-guess", a_session(), "rank 0 gave up"),
    "the previous protocol's ABORT": lambda: b"ABORT rank 0 gave up after 600 s\n",
}


@pytest.mark.parametrize("forged", FORGED, ids=list(FORGED))
def test_an_impostor_on_the_first_port_neither_releases_nor_stops_the_worker(start_rank0, forged):
    server, served = start_rank0(nnodes=2)
    with BarrierImpostor(ADDRESS, 0, server.port, FORGED[forged]()) as impostor:
        result = join([impostor.port, server.port], 1, 2)
    assert [deception.forged_sent for deception in impostor.deceptions] == [True], "the test proved nothing"
    # Released by the real rank 0, on the next candidate port, after refusing the impostor's line.
    assert result.port == server.port
    assert served.result().workers[0]["rank"] == 1
    [refused] = result.rejections
    assert refused["peer"] == f"{ADDRESS}:{impostor.port}"
    assert "failed authentication" in refused["reason"] or "neither GO nor ABORT" in refused["reason"]


def test_what_an_impostor_captured_is_rejected_when_replayed_to_the_real_rank0(start_rank0):
    server, served = start_rank0(nnodes=2)
    with BarrierImpostor(ADDRESS, 0, server.port, FORGED["GO under a guessed token"]()) as impostor:
        join([impostor.port, server.port], 1, 2)
    [deception] = impostor.replayed
    assert deception.captured.count(b"READY ") == 1
    assert deception.replay_answer == b""  # rank 0 closed the replay without a word
    reasons = [rejection["reason"] for rejection in served.result().rejections]
    assert "rank 1: READY failed authentication (wrong token, or a line replayed from another connection)" in reasons
    assert TOKEN.encode() not in deception.captured


def test_an_impostor_that_cannot_relay_a_greeting_gets_only_the_join_line(start_rank0):
    server, served = start_rank0(nnodes=2)
    with BarrierImpostor(ADDRESS, 0, server.port, FORGED["GO under a guessed token"](), relay=False) as impostor:
        result = join([impostor.port, server.port], 1, 2)
    [deception] = impostor.deceptions
    assert deception.captured.startswith(b"JOIN 1 node2 ") and deception.captured.count(b"\n") == 1
    assert result.port == server.port
    assert "HELLO failed authentication" in result.rejections[0]["reason"]


def test_a_go_whose_image_was_changed_on_the_way_does_not_release_the_worker(start_rank0, pool):
    """A relay between the worker and the real rank 0 that passes everything on but rewrites the image in GO."""
    server, served = start_rank0(nnodes=2)
    relay = socket.create_server((ADDRESS, 0))

    def rewrite_go():
        with relay, relay.accept()[0] as worker, socket.create_connection((ADDRESS, server.port)) as rank0:
            worker.settimeout(5)
            rank0.settimeout(5)
            for _ in range(2):  # JOIN and READY up, HELLO and GO down
                rank0.sendall(read_line(worker))
                line = read_line(rank0)
                worker.sendall(line.replace(IMAGE.encode(), OTHER_IMAGE.encode()))
            read_until_closed(worker)

    relayed = pool.submit(rewrite_go)
    with pytest.raises(BarrierTimeout) as caught:  # the relay's port is its only candidate
        join([relay.getsockname()[1]], 1, 2, timeout=1.0)
    relayed.result(timeout=5)
    assert served.result().workers[0]["rank"] == 1  # rank 0 did send its GO: the worker refused the altered one
    assert "GO failed authentication" in caught.value.rejections[0]["reason"]


def test_worker_with_another_token_refuses_rank0s_greeting_and_sends_no_ready(start_rank0):
    server, served = start_rank0(nnodes=2, timeout=1.0)
    with pytest.raises(BarrierTimeout, match="HELLO failed authentication"):
        join([server.port], 1, 2, token="a-guessed-token", timeout=0.5)
    with pytest.raises(BarrierTimeout) as caught:
        served.result()
    assert {rejection["reason"] for rejection in caught.value.rejections} == {"closed without sending READY"}


# ------------------------------------------------------------------------------------------------- the rejections


def rejected_then_released(start_rank0, pool, send, idle_timeout=5.0, greeted=False):
    """Send a bad connection's bytes (after a proper JOIN when `greeted`), see it closed without a reply, then an
    honest worker is still released."""
    server, served = start_rank0(nnodes=2, idle_timeout=idle_timeout)
    with RawWorker(server.port) if greeted else bare_connection(server.port) as bad:
        host, port = bad.getsockname()
        peer = f"{host}:{port}"
        send(bad)
        assert read_until_closed(bad) == b""
    assert join([server.port], 1, 2).port == server.port
    rejections = served.result().rejections
    assert [rejection["peer"] for rejection in rejections] == [peer]
    return rejections[0]["reason"]


def test_ready_under_a_wrong_token_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda w: w.sendall(w.ready(token="guess")), greeted=True)
    assert reason == "rank 1: READY failed authentication (wrong token, or a line replayed from another connection)"


def test_rank_out_of_range_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(format_join_line(7, "node8", new_nonce())))
    assert reason == "rank 7 out of range: workers are ranks 1..1"


def test_garbage_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"\x16\x03\x01\x02\x00\x01\n"))
    assert reason.startswith("garbage")


def test_garbage_after_the_greeting_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda w: w.sendall(b"GET / HTTP/1.0\n"), greeted=True)
    assert reason == "garbage: not a READY line"


def test_oversized_line_without_newline_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"JOIN " + b"x" * MAX_LINE_BYTES))
    assert reason.startswith("oversized line")


def test_oversized_line_with_newline_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"R" * 600 + b"\n"))
    assert reason.startswith("oversized line")


def test_half_sent_line_is_rejected(start_rank0, pool):
    def send_half(worker):
        worker.sendall(worker.ready()[:20])
        worker.shutdown(socket.SHUT_WR)

    assert rejected_then_released(start_rank0, pool, send_half, greeted=True) == "closed mid-line: half-sent READY"


def test_idle_connection_is_dropped_after_the_idle_timeout(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: None, idle_timeout=0.3)
    assert reason == "idle: no complete JOIN line within 0.3 s"


def test_greeted_connection_that_never_sends_ready_is_dropped_after_the_idle_timeout(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: None, idle_timeout=0.3, greeted=True)
    assert reason == "idle: no complete READY line within 0.3 s"


def test_duplicate_rank_from_another_host_is_rejected(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with RawWorker(server.port) as first, RawWorker(server.port, hostname="node9") as impostor:
        first.sendall(first.ready())
        wait_for_arrival(server, 1)
        impostor.sendall(impostor.ready())
        assert read_until_closed(impostor.sock) == b""
        join([server.port], 2, 3)
        assert first.release() == Release(True, IMAGE)
    [rejection] = served.result().rejections
    assert rejection["reason"].startswith("duplicate rank 1: already joined from node2")


def test_same_rank_reconnecting_from_the_same_host_replaces_its_old_connection(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with RawWorker(server.port) as old:
        old.sendall(old.ready())
        wait_for_arrival(server, 1)
        rejoined = pool.submit(join, [server.port], 1, 3)
        assert read_until_closed(old.sock) == b""  # dropped in favour of the new connection
        join([server.port], 2, 3)
    assert rejoined.result().port == server.port
    assert served.result().rejections == []


def test_ready_sent_byte_by_byte_is_accepted(start_rank0):
    server, served = start_rank0(nnodes=2)
    with RawWorker(server.port) as slow:
        for byte in slow.ready():
            slow.send(bytes([byte]))
            time.sleep(0.001)  # not synchronisation: one byte per packet
        assert slow.release() == Release(True, IMAGE)
    assert served.result().workers[0]["hostname"] == "node2"


def test_idle_and_half_sent_connections_do_not_delay_the_release(start_rank0, pool):
    server, served = start_rank0(nnodes=4, idle_timeout=60)
    loiterers = [bare_connection(server.port) for _ in range(40)]
    greeted = [RawWorker(server.port) for _ in range(10)]
    try:
        for loiterer in greeted:
            loiterer.sendall(loiterer.ready()[:30])
        workers = [pool.submit(join, [server.port], rank, 4) for rank in (1, 2, 3)]
        result = served.result(timeout=30)
        assert [worker.result().port for worker in workers] == [server.port] * 3
        assert result.rejections == []  # released while all 50 were still connected
    finally:
        for loiterer in loiterers + greeted:
            loiterer.close()


def test_rejections_are_logged_with_the_peer_address_and_never_the_token(start_rank0, pool, caplog):
    caplog.set_level(logging.DEBUG)
    server, served = start_rank0(nnodes=2)
    with RawWorker(server.port) as bad:
        host, port = bad.getsockname()
        peer = f"{host}:{port}"
        bad.sendall(bad.ready(token=TOKEN + "x"))
        read_until_closed(bad.sock)
    join([server.port], 1, 2)
    served.result()
    assert f"rejected {peer}: rank 1: READY failed authentication" in caplog.text
    assert TOKEN not in caplog.text


def _rank0_out_of_descriptors(port, answers):
    """Rank 0 in a child process whose every descriptor is taken for 1 s after it listens, then freed."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    with RankBarrierServer(ADDRESS, [port], 2, IMAGE, TOKEN, job_id=JOB) as server:
        server.listen()
        taken = []
        with contextlib.suppress(OSError):
            while True:
                taken.append(os.open("/dev/null", os.O_RDONLY))
        threading.Timer(1.0, lambda: [os.close(fd) for fd in taken]).start()
        answers.send(server.serve(timeout=20).warnings)


def test_rank0_out_of_descriptors_pauses_accepting_and_warns_instead_of_spinning():
    port = free_port()
    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    rank0 = multiprocessing.get_context("fork").Process(target=_rank0_out_of_descriptors, args=(port, child_end))
    rank0.start()
    try:
        assert join([port], 1, 2, timeout=20).port == port  # released once a descriptor was free again
        assert parent_end.poll(20)
        (warning,) = parent_end.recv()
    finally:
        rank0.join(20)
    # About 1 s without descriptors: a busy loop on the readable listener would fail accept() thousands of times.
    failures = int(re.search(r"could not accept a connection (\d+) time\(s\)", warning).group(1))
    assert 1 <= failures <= 10, warning
    assert "Too many open files" in warning and "ulimit -n" in warning


def test_a_line_is_taken_whole_from_the_buffer_and_what_follows_stays():
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import take_line

    buffer = bytearray(b"JOIN 1 node2 ab\nREA")
    assert take_line(buffer) == b"JOIN 1 node2 ab" and buffer == bytearray(b"REA")
    assert take_line(buffer) is None and buffer == bytearray(b"REA")
