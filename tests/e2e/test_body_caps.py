"""Hostile bodies against a real server process: an unauthenticated 512 MiB body is refused while
it streams, before anything parses it, and the server's memory does not follow it."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.processes import Stack

HUGE = 512 << 20
CHUNK = 1 << 20


@pytest.fixture
def server(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path, clean_db, clean_redis)
    try:
        stack.start_server()
        yield stack
    finally:
        stack.close()


def send_headers(port: int, headers: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(headers.encode())
    return sock


def read_answer(sock: socket.socket) -> bytes:
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_a_declared_huge_body_is_refused_before_a_byte_is_read(server: Stack) -> None:
    started = time.monotonic()
    sock = send_headers(
        server.port,
        f"POST /api/v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n",
    )
    with sock:
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - started < 10


def test_a_streamed_huge_body_is_cut_off_and_memory_stays_flat(server: Stack) -> None:
    process = psutil.Process(server.procs["server"].pid)
    before = process.memory_info().rss
    started = time.monotonic()
    sock = send_headers(
        server.port,
        "POST /api/v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n",
    )
    sent, block = 0, b"0" * CHUNK
    with sock:
        while sent < HUGE:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered (and stops reading)
            try:
                sock.sendall(f"{CHUNK:x}\r\n".encode() + block + b"\r\n")
            except OSError:  # it closed the connection after answering
                break
            sent += CHUNK
        answer = read_answer(sock)
    grown = process.memory_info().rss - before
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < HUGE, "the server read the whole body"
    assert grown < 64 << 20, f"the server grew by {grown >> 20} MiB"
    assert time.monotonic() - started < 10


@pytest.fixture
def small_door(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Stack]:
    """A server that refuses node calls past 16 on its agents' threads."""
    stack = Stack(tmp_path, clean_db, clean_redis, PHALANX_MAX_NODE_CALLS_IN_FLIGHT=str(DOOR))
    try:
        stack.start_server()
        yield stack
    finally:
        stack.close()


DOOR = 16


def test_bodies_trickled_in_never_keep_the_nodes_calls_out(small_door: Stack) -> None:
    """Node calls are refused past a limit of calls on the agents' threads
    (`server/api/admission.py`). Counted from the door, more connections than that limit, each
    sending a node call's body slowly and with no credential, kept every node's calls out."""
    slow = []
    try:
        for _ in range(DOOR + 8):
            sock = send_headers(
                small_door.port,
                "POST /api/v1/agents/1/logs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n{",
            )
            slow.append(sock)
        # every slow call has reached the app once the server has answered a request sent after them
        with small_door.client() as client:
            client.list_jobs()
        sock = send_headers(
            small_door.port,
            "POST /api/v1/allocations/1/metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        )
        with sock:
            answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    finally:
        for sock in slow:
            sock.close()
