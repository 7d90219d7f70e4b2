"""`wait_for_idle_gloo_workers`: it waits while a gloo worker thread runs and returns once they
all block, on threads named as gloo names its workers and on a real gloo process group."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.train._teardown import GLOO_WORKER_NAME, wait_for_idle_gloo_workers

PR_SET_NAME = 15


def named_thread(body: Callable[[], None]) -> threading.Thread:
    """A thread whose kernel name is gloo's worker name, running `body`."""

    def run() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, GLOO_WORKER_NAME.encode(), 0, 0, 0)
        body()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def gloo_group() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_it_waits_while_a_worker_runs_and_returns_once_it_blocks() -> None:
    release = threading.Event()
    named = threading.Event()
    spinning = threading.Event()

    def spin_then_block() -> None:
        named.set()
        while not spinning.is_set():
            pass  # runnable (state R) until told to block
        release.wait()

    thread = named_thread(spin_then_block)
    named.wait(5)
    try:
        started = time.monotonic()
        assert not wait_for_idle_gloo_workers(0.2), "a running worker is not idle"
        assert time.monotonic() - started >= 0.2
        spinning.set()
        assert wait_for_idle_gloo_workers(5.0)
    finally:
        spinning.set()
        release.set()
        thread.join(5)


def test_the_workers_of_a_real_group_are_idle_after_a_collective(gloo_group: None) -> None:
    group = dist.group.WORLD  # held, as a DDP model holds it
    values = torch.ones(4)
    work = dist.all_reduce(values, async_op=True)
    assert work is not None
    work.wait()
    dist.destroy_process_group()  # its workers live on while the group is held
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    assert GLOO_WORKER_NAME in names, "gloo still names its worker threads so"
    started = time.monotonic()
    assert wait_for_idle_gloo_workers(5.0)
    assert time.monotonic() - started < 1.0
    assert values.tolist() == [1.0, 1.0, 1.0, 1.0]
    del group
