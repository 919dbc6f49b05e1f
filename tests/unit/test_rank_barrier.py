"""The rank-0 image-ready barrier, over real sockets on loopback: rank 0 in a thread, workers in threads or raw."""

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ansible.module_utils.rank_barrier import (
    MAX_LINE_BYTES,
    BarrierAborted,
    BarrierConfigError,
    BarrierError,
    BarrierTimeout,
    ProtocolViolation,
    RankBarrierServer,
    ReadyMessage,
    derive_barrier_ports,
    format_ready_line,
    join_rank_barrier,
    parse_port_range,
    parse_ready_line,
    raise_open_files_limit,
)

ADDRESS = "127.0.0.1"
TOKEN = "s3cret-Barrier-Token-42"
IMAGE = "sha256:" + "a" * 64
OTHER_IMAGE = "sha256:" + "b" * 64


def free_port(address=ADDRESS):
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def ready(rank, hostname, image_id=IMAGE, token=TOKEN):
    return f"READY {token} {rank} {hostname} {image_id}\n".encode()


def raw_worker(port, address=ADDRESS):
    """A hand-driven worker connection, for what the real worker never sends; rank 0's HELLO already read."""
    sock = socket.create_connection((address, port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert read_line(sock) == b"HELLO\n"
    return sock


def wait_for_arrival(server, rank):
    """Block until rank 0 accepted `rank`'s READY (the protocol does not acknowledge it)."""
    deadline = time.monotonic() + 5
    while rank not in server.arrived_ranks:
        assert time.monotonic() < deadline, f"rank {rank} never arrived"
        time.sleep(0.005)


def read_until_closed(sock):
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def read_line(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def pool():
    executor = ThreadPoolExecutor(max_workers=8)
    yield executor
    executor.shutdown(wait=True)


@pytest.fixture
def start_rank0(pool):
    """start_rank0(nnodes, ...) -> (server, future of serve()); rank 0 already listens when it returns."""
    servers = []

    def start(nnodes, image_id=IMAGE, hosts=None, timeout=5.0, idle_timeout=5.0, ports=None, address=ADDRESS):
        server = RankBarrierServer(
            address, ports or [free_port(address)], nnodes, image_id, TOKEN, hosts, idle_timeout
        )
        servers.append(server)
        server.listen()
        return server, pool.submit(server.serve, timeout)

    yield start
    for server in servers:
        server.close()


def join(ports, rank, nnodes, image_id=IMAGE, timeout=5.0, **options):
    options.setdefault("hostname", f"node{rank + 1}")
    return join_rank_barrier(ADDRESS, ports, rank, nnodes, TOKEN, image_id, timeout, **options)


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


def test_ready_line_round_trips():
    line = format_ready_line(TOKEN, 3, "node4", IMAGE)
    assert line.endswith(b"\n")
    assert parse_ready_line(line[:-1], TOKEN, 4) == ReadyMessage(3, "node4", IMAGE)


@pytest.mark.parametrize(
    "line, reason",
    [
        (f"READY wrong-token 1 node2 {IMAGE}", "wrong token"),
        (f"READY {TOKEN} 0 node1 {IMAGE}", "out of range"),
        (f"READY {TOKEN} 4 node5 {IMAGE}", "out of range"),
        (f"READY {TOKEN} -1 node2 {IMAGE}", "not a plain decimal integer"),
        (f"READY {TOKEN} +1 node2 {IMAGE}", "not a plain decimal integer"),
        (f"READY {TOKEN} 1_0 node2 {IMAGE}", "not a plain decimal integer"),
        (f"READY {TOKEN} 01 node2 {IMAGE}", "not a plain decimal integer"),
        (f"READY {TOKEN} one node2 {IMAGE}", "not a plain decimal integer"),
        (f"READY {TOKEN}  1 node2 {IMAGE}", "6 space-separated fields"),
        (f"READY {TOKEN} 1 node2", "4 space-separated fields"),
        (f"READY {TOKEN} 1 node2 {IMAGE}\r", "non-printable"),
        ("GET / HTTP/1.1", "not a READY line"),
    ],
)
def test_ready_line_is_parsed_strictly(line, reason):
    with pytest.raises(ProtocolViolation, match=reason):
        parse_ready_line(line.encode(), TOKEN, 4)


def test_non_ascii_line_is_garbage():
    with pytest.raises(ProtocolViolation, match="garbage"):
        parse_ready_line(b"READY \xff\xfe 1 n i", TOKEN, 4)


def test_rejection_reasons_never_quote_the_token():
    near_miss = TOKEN + "x"
    with pytest.raises(ProtocolViolation) as caught:
        parse_ready_line(f"READY {near_miss} 1 node2 {IMAGE}".encode(), TOKEN, 4)
    assert TOKEN not in str(caught.value)


def test_a_token_the_protocol_cannot_carry_is_refused_without_quoting_it():
    with pytest.raises(BarrierConfigError) as caught:
        format_ready_line("two words", 1, "node2", IMAGE)
    assert "two words" not in str(caught.value)


def test_a_ready_line_over_the_length_bound_is_refused_before_sending():
    with pytest.raises(BarrierConfigError, match="shorter"):
        format_ready_line(TOKEN, 1, "n" * 250, "i" * 255)


# ------------------------------------------------------------------------------------------------- the release


def test_rank0_releases_when_every_worker_arrived_with_the_announced_image(start_rank0, pool):
    server, served = start_rank0(nnodes=4)
    workers = [pool.submit(join, [server.port], rank, 4) for rank in (1, 2, 3)]
    result = served.result()
    assert [worker.result().port for worker in workers] == [server.port] * 3
    assert [(w["rank"], w["hostname"]) for w in result.workers] == [(1, "node2"), (2, "node3"), (3, "node4")]
    assert result.port == server.port and result.rejections == []


def test_single_node_run_releases_at_once_without_listening():
    with RankBarrierServer(ADDRESS, [free_port()], 1, IMAGE, TOKEN) as server:
        result = server.serve(timeout=5)
    assert result.port is None and result.workers == []


def test_rank0_listens_only_on_master_addr(start_rank0, pool):
    server, served = start_rank0(nnodes=2, address="127.0.0.2")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    join_rank_barrier("127.0.0.2", [server.port], 1, 2, TOKEN, IMAGE, timeout=5, hostname="node2")
    assert served.result().workers[0]["rank"] == 1


def test_rank0_binds_the_next_candidate_when_the_first_is_taken():
    with socket.create_server((ADDRESS, 0)) as occupant:
        taken, free = occupant.getsockname()[1], free_port()
        with RankBarrierServer(ADDRESS, [taken, free], 2, IMAGE, TOKEN) as server:
            assert server.listen() == free


def test_rank0_fails_naming_the_ports_when_every_candidate_is_taken():
    with socket.create_server((ADDRESS, 0)) as occupant:
        taken = occupant.getsockname()[1]
        with RankBarrierServer(ADDRESS, [taken], 2, IMAGE, TOKEN) as server:
            with pytest.raises(BarrierError, match=f"in use \\({taken}\\)"):
                server.listen()


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_rank0_refuses_to_listen_on_every_interface(address):
    with pytest.raises(BarrierConfigError, match="every interface"):
        RankBarrierServer(address, [free_port()], 2, IMAGE, TOKEN)


def test_master_addr_must_be_an_ip_address():
    with pytest.raises(BarrierConfigError, match="must be an IP address"):
        RankBarrierServer("node1", [free_port()], 2, IMAGE, TOKEN)


def test_hosts_must_name_every_rank():
    with pytest.raises(BarrierConfigError, match="3 names for nnodes=3"):
        RankBarrierServer(ADDRESS, [free_port()], 3, IMAGE, TOKEN, hosts=["node1", "node2"])


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
            connection = raw_worker(server.port)
            connection.sendall(ready(rank, f"node{rank + 1}"))
            connections.append(connection)
        assert len(served.result().workers) == workers
        assert {read_line(connection) for connection in connections} == {b"GO\n"}
    finally:
        for connection in connections:
            connection.close()


# --------------------------------------------------------------------------------------------------- the workers


def test_worker_started_before_rank0_listens_joins_once_it_does(pool):
    port = free_port()
    worker = pool.submit(join, [port], 1, 2)
    time.sleep(0.3)  # the worker meets a refused connection first
    with RankBarrierServer(ADDRESS, [port], 2, IMAGE, TOKEN) as server:
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


def test_worker_never_sends_its_token_to_a_listener_that_does_not_greet(start_rank0, pool):
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
        assert heard.result(timeout=5) == b""
    assert result.port == server.port
    assert served.result().workers[0]["rank"] == 1


def test_worker_moves_past_another_jobs_barrier_on_a_colliding_port(start_rank0, pool):
    with RankBarrierServer(ADDRESS, [free_port()], 2, IMAGE, "another-jobs-token") as other_job:
        other_job.listen()
        other_served = pool.submit(other_job.serve, 2.0)
        server, served = start_rank0(nnodes=2)
        result = join([other_job.port, server.port], 1, 2)
        assert result.port == server.port
        with pytest.raises(BarrierTimeout):
            other_served.result()
    assert [rejection["reason"] for rejection in other_job.rejections] == ["wrong token"]


def test_abort_check_stops_a_worker_long_before_its_deadline():
    calls = []

    def run_given_up():
        calls.append(time.monotonic())
        return "rank 0 (node1) gave up: every barrier port candidate is in use" if len(calls) > 2 else None

    started = time.monotonic()
    with pytest.raises(BarrierAborted, match="rank 1 waited at the barrier: rank 0 \\(node1\\) gave up: every") as caught:
        join([free_port()], 1, 2, timeout=60, abort_check=run_given_up)
    assert time.monotonic() - started < 5
    assert caught.value.reason.startswith("rank 0 (node1) gave up")


def test_rank0_reports_when_each_worker_arrived(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    first = pool.submit(join, [server.port], 1, 3)
    wait_for_arrival(server, 1)
    time.sleep(0.2)
    join([server.port], 2, 3)
    first.result()
    early, late = served.result().workers
    assert 0 <= early["arrived_seconds"] and late["arrived_seconds"] - early["arrived_seconds"] >= 0.2


def fake_rank0(pool, send_after_ready):
    """A hand-driven rank 0 on a free port: greets byte by byte, reads READY, then runs send_after_ready(conn)."""
    listener = socket.create_server((ADDRESS, 0))

    def serve():
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(5)
                for byte in b"HELLO\n":
                    connection.sendall(bytes([byte]))
                    time.sleep(0.01)
                assert read_line(connection).startswith(b"READY ")
                send_after_ready(connection)

    return listener.getsockname()[1], pool.submit(serve)


def test_worker_reads_replies_split_across_packets(pool):
    def go_in_pieces(connection):
        for piece in (b"G", b"O", b"\n"):
            connection.sendall(piece)
            time.sleep(0.01)

    port, served = fake_rank0(pool, go_in_pieces)
    assert join([port], 1, 2).port == port
    served.result(timeout=5)


def test_worker_greeted_but_never_released_times_out_at_its_deadline(pool):
    port, served = fake_rank0(pool, lambda connection: time.sleep(1.0))
    started = time.monotonic()
    with pytest.raises(BarrierTimeout, match=f"port {port}: no GO before the deadline"):
        join([port], 1, 2, timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 2
    served.result(timeout=5)


def test_worker_reconnects_and_resends_ready_when_its_connection_drops_before_go(pool):
    port = free_port()
    worker = pool.submit(join, [port], 1, 2)
    with socket.create_server((ADDRESS, port)) as first_rank0:
        connection, _ = first_rank0.accept()
        with connection:
            connection.settimeout(5)
            connection.sendall(b"HELLO\n")
            assert read_line(connection).startswith(b"READY ")  # then the connection breaks before GO
    with RankBarrierServer(ADDRESS, [port], 2, IMAGE, TOKEN) as server:
        result = server.serve(timeout=5)
    assert worker.result().port == port
    assert result.workers[0]["rank"] == 1


def test_image_mismatch_aborts_every_connected_worker_naming_the_node(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with raw_worker(server.port) as waiting:
        waiting.sendall(ready(1, "node2"))
        wait_for_arrival(server, 1)
        stale = pool.submit(join, [server.port], 2, 3, image_id=OTHER_IMAGE)
        assert read_line(waiting).startswith(b"ABORT node node3 (rank 2) has image " + OTHER_IMAGE.encode())
    with pytest.raises(BarrierAborted, match=f"node node3 \\(rank 2\\) has image {OTHER_IMAGE}, but rank 0 announced"):
        served.result()
    with pytest.raises(BarrierAborted, match="node node3 \\(rank 2\\)"):
        stale.result()


def test_timeout_names_the_missing_ranks_and_their_hostnames(start_rank0):
    server, served = start_rank0(nnodes=4, hosts=["gpu01", "gpu02", "gpu03", "gpu04"], timeout=0.5)
    with raw_worker(server.port) as waiting:
        waiting.sendall(ready(1, "gpu02"))
        wait_for_arrival(server, 1)
        with pytest.raises(BarrierTimeout, match="missing ranks 2 \\(gpu03\\), 3 \\(gpu04\\)") as caught:
            served.result()
    assert caught.value.missing == [(2, "gpu03"), (3, "gpu04")]


def test_connected_workers_get_abort_when_rank0_gives_up(start_rank0):
    server, served = start_rank0(nnodes=3, timeout=0.5)
    with raw_worker(server.port) as waiting:
        waiting.sendall(ready(1, "node2"))
        assert read_line(waiting).startswith(b"ABORT rank 0 gave up after 0.5 s: missing ranks 2")
    with pytest.raises(BarrierTimeout):
        served.result()


# ------------------------------------------------------------------------------------------------- the rejections


def rejected_then_released(start_rank0, pool, send, idle_timeout=5.0):
    """Send a bad connection's bytes, see it closed without a reply, then an honest worker is still released."""
    server, served = start_rank0(nnodes=2, idle_timeout=idle_timeout)
    with raw_worker(server.port) as bad:
        peer = "{}:{}".format(*bad.getsockname())
        send(bad)
        assert read_until_closed(bad) == b""
    assert join([server.port], 1, 2).port == server.port
    rejections = served.result().rejections
    assert [rejection["peer"] for rejection in rejections] == [peer]
    return rejections[0]["reason"]


def test_wrong_token_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(ready(1, "node2", token="guess")))
    assert reason == "wrong token"


def test_rank_out_of_range_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(ready(7, "node8")))
    assert reason == "rank 7 out of range: workers are ranks 1..1"


def test_garbage_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"\x16\x03\x01\x02\x00\x01\n"))
    assert reason.startswith("garbage")


def test_oversized_line_without_newline_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"READY " + b"x" * MAX_LINE_BYTES))
    assert reason.startswith("oversized line")


def test_oversized_line_with_newline_is_rejected(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: s.sendall(b"R" * 600 + b"\n"))
    assert reason.startswith("oversized line")


def test_half_sent_line_is_rejected(start_rank0, pool):
    def send_half(sock):
        sock.sendall(ready(1, "node2")[:20])
        sock.shutdown(socket.SHUT_WR)

    assert rejected_then_released(start_rank0, pool, send_half) == "closed mid-line: half-sent READY"


def test_idle_connection_is_dropped_after_the_idle_timeout(start_rank0, pool):
    reason = rejected_then_released(start_rank0, pool, lambda s: None, idle_timeout=0.3)
    assert reason == "idle: no complete READY line within 0.3 s"


def test_duplicate_rank_from_another_host_is_rejected(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with raw_worker(server.port) as first, raw_worker(server.port) as impostor:
        first.sendall(ready(1, "node2"))
        wait_for_arrival(server, 1)
        impostor.sendall(ready(1, "node9"))
        assert read_until_closed(impostor) == b""
        join([server.port], 2, 3)
        assert read_line(first) == b"GO\n"
    [rejection] = served.result().rejections
    assert rejection["reason"].startswith("duplicate rank 1: already joined from node2")


def test_same_rank_reconnecting_from_the_same_host_replaces_its_old_connection(start_rank0, pool):
    server, served = start_rank0(nnodes=3)
    with raw_worker(server.port) as old:
        old.sendall(ready(1, "node2"))
        wait_for_arrival(server, 1)
        rejoined = pool.submit(join, [server.port], 1, 3)
        assert read_until_closed(old) == b""  # dropped in favour of the new connection
        join([server.port], 2, 3)
    assert rejoined.result().port == server.port
    assert served.result().rejections == []


def test_ready_sent_byte_by_byte_is_accepted(start_rank0):
    server, served = start_rank0(nnodes=2)
    with raw_worker(server.port) as slow:
        for byte in ready(1, "node2"):
            slow.send(bytes([byte]))
            time.sleep(0.001)
        assert read_line(slow) == b"GO\n"
    assert served.result().workers[0]["hostname"] == "node2"


def test_idle_and_half_sent_connections_do_not_delay_the_release(start_rank0, pool):
    server, served = start_rank0(nnodes=4, idle_timeout=60)
    loiterers = [raw_worker(server.port) for _ in range(50)]
    try:
        for loiterer in loiterers[:10]:
            loiterer.sendall(ready(1, "node2")[:30])
        workers = [pool.submit(join, [server.port], rank, 4) for rank in (1, 2, 3)]
        result = served.result(timeout=30)
        assert [worker.result().port for worker in workers] == [server.port] * 3
        assert result.rejections == []  # released while all 50 were still connected
    finally:
        for loiterer in loiterers:
            loiterer.close()


def test_rejections_are_logged_with_the_peer_address_and_never_the_token(start_rank0, pool, caplog):
    caplog.set_level(logging.DEBUG)
    server, served = start_rank0(nnodes=2)
    with raw_worker(server.port) as bad:
        peer = "{}:{}".format(*bad.getsockname())
        bad.sendall(ready(1, "node2", token=TOKEN + "x"))
        read_until_closed(bad)
    join([server.port], 1, 2)
    served.result()
    assert f"rejected {peer}: wrong token" in caplog.text
    assert TOKEN not in caplog.text
