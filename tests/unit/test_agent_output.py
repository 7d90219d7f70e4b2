"""A job's output never grows the agent without bound and is never dropped: a 2 GiB line without a
newline arrives as 64 KiB pieces with its rank, and lines wait (holding the job up) once 8 MiB of
an allocation's output is waiting to ship."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import psutil

from phalanx.schemas import AllocationLogBatch, LogLineIn, ReportOutcome
from worker_agent.agent import MAX_PENDING_BYTES, LogShipper
from worker_agent.launcher import MAX_LINE_BYTES, NodeProcess

TWO_GIB = 2 << 30


def test_a_2_gib_line_without_newline_arrives_whole_in_bounded_pieces() -> None:
    read_fd, write_fd = os.pipe()
    chunk = b"x" * (1 << 20)

    def write() -> None:
        with os.fdopen(write_fd, "wb", buffering=0) as out:
            out.write(b"[default1]:" + "é".encode())  # a rank's prefix, and a character split at the edge
            for _ in range(TWO_GIB >> 20):
                out.write(chunk)
            out.write(b"\n[default0]:after\n")

    pieces = 0
    sizes: list[int] = []
    ranks: set[int | None] = set()
    total = 0
    last = ""

    def on_line(rank: int | None, stream: str, text: str) -> None:
        nonlocal pieces, total, last
        pieces += 1
        total += len(text.encode())
        if len(sizes) < 3:
            sizes.append(len(text.encode()))
        ranks.add(rank) if text != "after" else None
        last = f"{rank}:{text}" if len(text) < 10 else last

    rss_before = psutil.Process().memory_info().rss
    writer = threading.Thread(target=write)
    writer.start()
    with os.fdopen(read_fd, "rb") as stream:
        NodeProcess._pump(stream, "stdout", 10, on_line)
    writer.join()
    grown = psutil.Process().memory_info().rss - rss_before
    assert total == len("é".encode()) + TWO_GIB + len("after")
    assert pieces == -(-(TWO_GIB + len("[default1]:é".encode())) // MAX_LINE_BYTES) + 1
    assert all(size <= MAX_LINE_BYTES for size in sizes)
    assert ranks == {11}  # every piece of the long line keeps rank 1's prefix (node's first rank 10)
    assert last == "10:after"  # the next line is read as a line of its own
    assert grown < 64 << 20, grown


class _RecordingClient:
    def __init__(self) -> None:
        self.shipped = 0

    def ship_log_batches(self, agent_id: int, batches: list[AllocationLogBatch]) -> list[ReportOutcome]:
        self.shipped += sum(len(line.line) for batch in batches for line in batch.lines)
        return [ReportOutcome(status=204) for _ in batches]


def test_the_shipper_holds_the_job_up_once_8_mib_wait_and_drops_nothing() -> None:
    client = _RecordingClient()
    agent: Any = SimpleNamespace(client=client, agent_id=1, stopping=threading.Event())
    shipper = LogShipper(agent)  # its thread is not started: nothing ships until the test flushes
    line = LogLineIn(rank=0, time=1.0, line="y" * 65_536)
    queued = MAX_PENDING_BYTES // 65_536 + 1
    for _ in range(queued):  # up to just past the cap: taken at once
        shipper.add(7, line)
    held = threading.Thread(target=shipper.add, args=(7, line))
    held.start()
    held.join(timeout=1.0)
    assert held.is_alive()  # the pump (and so the job's next write) waits for the output to ship
    shipper.flush(7)  # what the shipper's thread does every second
    held.join(timeout=10)
    assert not held.is_alive()
    shipper.flush(7)
    assert client.shipped == (queued + 1) * 65_536  # nothing dropped
