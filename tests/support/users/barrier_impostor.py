"""A local user pretending to be rank 0: a listener on a barrier's first candidate port, for the barrier's tests.

It holds no token, so the best it can do is relay: each worker's JOIN goes to the real rank 0 (on the next
candidate port) and rank 0's HELLO comes back to the worker, so the worker's greeting check passes. It keeps
everything the worker sends, replays it to the real rank 0 on a fresh connection while the real barrier still
waits for that worker, and then answers the worker's READY with a line of its own (a forged GO or ABORT).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.wire import new_nonce


def read_line(sock: socket.socket) -> bytes:
    """One line, newline included (b"" or a partial line when the peer closes first)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


@dataclass
class Deception:
    """One worker connection the impostor took: what the worker sent it, and how its replay went."""

    captured: bytes = b""
    # What the real rank 0 sent back after its greeting when the capture was replayed (b"": it closed the
    # connection without a word); None when there was no READY to replay.
    replay_answer: bytes | None = None
    forged_sent: bool = False


class BarrierImpostor:
    """Listens on (address, port) until closed; `relay=False` greets with a nonce and a MAC it made up instead."""

    def __init__(self, address: str, port: int, real_port: int, forged: bytes, relay: bool = True):
        self.address, self.real_port, self.forged, self.relay = address, real_port, forged, relay
        self.listener = socket.create_server((address, port))
        self.port = self.listener.getsockname()[1]
        self.deceptions: list[Deception] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def __enter__(self) -> BarrierImpostor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(5)
        self.listener.close()
        for thread in self._threads:
            thread.join(10)

    @property
    def replayed(self) -> list[Deception]:
        """The connections on which the impostor got a READY and replayed it to the real rank 0."""
        return [deception for deception in self.deceptions if deception.replay_answer is not None]

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                worker, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._deceive, args=(worker,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _deceive(self, worker: socket.socket) -> None:
        deception = Deception()
        self.deceptions.append(deception)
        with worker:
            worker.settimeout(10)
            join_line = read_line(worker)
            deception.captured += join_line
            greeting = self._greeting(join_line)
            if not greeting:
                return  # the real rank 0 never listened: nothing to relay
            worker.sendall(greeting)
            ready_line = read_line(worker)
            deception.captured += ready_line
            if not ready_line.startswith(b"READY "):
                return  # the worker refused the greeting
            deception.replay_answer = self._replay(join_line, ready_line)
            worker.sendall(self.forged)
            deception.forged_sent = True
            try:
                deception.captured += read_until_closed(worker)
            except OSError:
                pass

    def _greeting(self, join_line: bytes) -> bytes:
        if not self.relay:
            return f"HELLO {new_nonce()} {new_nonce() * 2}\n".encode()
        # A worker that comes before the real rank 0 listens is held (within its 5 s reply timeout) until it does,
        # so that every worker meets the impostor first, whatever the start-up order.
        until = time.monotonic() + 4
        while True:
            try:
                with socket.create_connection((self.address, self.real_port), timeout=5) as rank0:
                    rank0.sendall(join_line)
                    return read_line(rank0)
            except ConnectionRefusedError:
                if time.monotonic() > until or self._stop.is_set():
                    return b""
                time.sleep(0.02)  # polling for rank 0's listener, bounded above
            except OSError:
                return b""

    def _replay(self, join_line: bytes, ready_line: bytes) -> bytes:
        with socket.create_connection((self.address, self.real_port), timeout=10) as rank0:
            rank0.sendall(join_line)
            read_line(rank0)  # rank 0's HELLO, with a fresh nonce of its own
            rank0.sendall(ready_line)
            return read_until_closed(rank0)
