"""A queue snapshot kept for `queue_snapshot_seconds`: the reads within that time share it (no
placement pass of their own), a job submitted since gets a fresh one on its own page (a list shows
it without a place until then), and an old one is shown while a thread replaces it. The kept
snapshots are computed in a process of their own (`SnapshotProcess`); the tests that count
computations compute them in this one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import make_url

from server import queue_status
from server.app import create_app
from server.db import engine_for, session_scope, upgrade
from server.queue_status import SUBMITTED_SINCE
from server.settings import Settings
from tests.agent_tokens import register_agent
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN
from tests.integration.test_api import USER
from tests.integration.test_fair_share import job, schedule, submit

KEPT_S = 60.0


@pytest.fixture
def kept_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"queue_snapshot_seconds": KEPT_S})


@pytest.fixture
def client(kept_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(kept_settings, enqueue=lambda *_, **__: None), follow_redirects=False) as test_client:
        yield test_client


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many queued jobs each snapshot computed in this process saw, in order."""
    seen: list[int] = []
    compute = queue_status.compute_queue_snapshot

    def counted(*args: Any) -> queue_status.QueueSnapshot:
        snapshot = compute(*args)
        seen.append(len(snapshot.queued))
        return snapshot

    monkeypatch.setattr(queue_status, "compute_queue_snapshot", counted)
    monkeypatch.setattr(queue_status.SnapshotProcess, "enabled", False)  # counted here, not there
    queue_status._kept.clear()
    return seen


def one_running_one_waiting(client: TestClient, settings: Settings) -> int:
    """One slot, a job on it and one queued behind it; the queued job's id."""
    register_agent(client, "n1", cpu_slots=1)
    submit(client, USER, "running")
    schedule(settings)
    return submit(client, USER, "waiting")


def held_computations(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """From now on a snapshot's computation sets the first event, then waits for the second."""
    inside, release = threading.Event(), threading.Event()
    compute = queue_status.compute_queue_snapshot

    def slow(*args: Any) -> queue_status.QueueSnapshot:
        inside.set()
        assert release.wait(10)
        return compute(*args)

    monkeypatch.setattr(queue_status, "compute_queue_snapshot", slow)
    return inside, release


def test_reads_share_a_kept_snapshot_until_a_newer_jobs_own_page_is_shown(
    client: TestClient, kept_settings: Settings, computed: list[int]
) -> None:
    register_agent(client, "n1", cpu_slots=1)
    running = submit(client, USER, "running")
    schedule(kept_settings)
    first, second = submit(client, USER, "first"), submit(client, USER, "second")
    assert job(client, second)["queue"]["position"] == 2
    assert computed == [2]
    for _ in range(3):
        assert job(client, first)["queue"]["position"] == 1
        listed = client.get("/api/v1/jobs", headers=USER).json()
        assert [row["queue"]["position"] if row["queue"] else None for row in listed] == [2, 1, None]
    assert client.get("/api/v1/queue", headers=USER).json()["queued"] == 2
    assert computed == [2], "every read within the kept time shared the first snapshot"

    third = submit(client, USER, "third")  # newer than the kept snapshot
    newest = client.get("/api/v1/jobs", headers=USER).json()[0]
    assert (newest["id"], newest["queue"]["position"]) == (third, None)  # a list shows the kept one
    assert newest["queue"]["estimate"] == SUBMITTED_SINCE
    assert computed == [2]
    assert job(client, third)["queue"]["position"] == 3  # its own page gets a fresh one
    assert computed == [2, 3]
    assert job(client, running)["queue"] is None  # a job that waits for nothing needs no snapshot
    assert computed == [2, 3]


def computations_done() -> None:
    """Until no snapshot is being computed (a thread holds its kept lock while it computes)."""
    for kept in list(queue_status._kept.values()):
        assert kept.lock.acquire(timeout=10), "a snapshot's computation did not end"
        kept.lock.release()


def test_an_old_snapshot_is_shown_while_a_thread_replaces_it(
    client: TestClient, kept_settings: Settings, computed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = one_running_one_waiting(client, kept_settings)
    assert job(client, waiting)["queue"]["position"] == 1
    assert client.post(f"/api/v1/jobs/{waiting}/hold", headers=USER).json()["held"] is True
    assert job(client, waiting)["queue"]["position"] == 1, "kept: the hold shows once the snapshot is replaced"
    assert computed == [1]
    later = queue_status._clock() + KEPT_S + 1
    monkeypatch.setattr(queue_status, "_clock", lambda: later)
    assert job(client, waiting)["queue"]["position"] == 1, "the old one, answered without waiting"
    computations_done()
    assert computed == [1, 1], "the old one started a computation of the next"
    assert job(client, waiting)["queue"]["position"] is None


def test_requests_that_come_while_one_computes_take_its_snapshot(
    kept_settings: Settings, client: TestClient, computed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    one_running_one_waiting(client, kept_settings)
    inside, release = held_computations(monkeypatch)
    results: list[queue_status.QueueSnapshot] = []

    def read() -> None:
        with session_scope(kept_settings.database_url) as session:
            results.append(queue_status.queue_snapshot(session, kept_settings))

    readers = [threading.Thread(target=read) for _ in range(4)]
    readers[0].start()
    assert inside.wait(10)
    for reader in readers[1:]:
        reader.start()
    release.set()
    for reader in readers:
        reader.join(10)
    assert len(results) == 4 and all(result is results[0] for result in results)


def test_the_queue_omits_a_job_that_left_it_since_the_kept_snapshot(
    client: TestClient, kept_settings: Settings, computed: list[int]
) -> None:
    waiting = one_running_one_waiting(client, kept_settings)
    before = client.get("/api/v1/queue", headers=USER).json()
    assert [entry["job_id"] for entry in before["entries"]] == [waiting] and before["queued"] == 1
    assert client.post(f"/api/v1/jobs/{waiting}/kill", headers=USER).status_code == 200
    after = client.get("/api/v1/queue", headers=USER).json()
    assert (after["entries"], after["queued"]) == ([], 0)
    assert computed == [1], "the kept snapshot still lists the job; the view drops it"


def test_a_list_shows_the_old_snapshot_while_a_thread_computes_the_next(
    client: TestClient, kept_settings: Settings, computed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = one_running_one_waiting(client, kept_settings)
    assert job(client, waiting)["queue"]["position"] == 1
    inside, release = held_computations(monkeypatch)
    later = queue_status._clock() + KEPT_S + 1
    monkeypatch.setattr(queue_status, "_clock", lambda: later)
    second = submit(client, USER, "second")
    listed = client.get("/api/v1/jobs", headers=USER).json()  # answered while the next one computes
    assert [(row["id"], row["queue"]["position"]) for row in listed[:2]] == [(second, None), (waiting, 1)]
    assert inside.wait(10), "the old snapshot started a computation of the next"
    assert job(client, waiting)["queue"]["position"] == 1, "a job the old one knows: its page does not wait"
    release.set()
    assert job(client, second)["queue"]["position"] == 2  # waited for the thread's snapshot, not its own
    assert computed == [1, 2], "the job pages computed nothing of their own"


def test_a_kept_snapshot_is_computed_in_a_process_of_its_own(client: TestClient, kept_settings: Settings) -> None:
    waiting = one_running_one_waiting(client, kept_settings)
    second = submit(client, USER, "second")
    queue_status._kept.clear()
    assert [job(client, i)["queue"]["position"] for i in (waiting, second)] == [1, 2]
    pool = queue_status.SnapshotProcess._pool
    assert pool is not None, "the snapshot was computed in the server's own process"
    assert all(process.pid != os.getpid() for process in pool._processes.values())
    with session_scope(kept_settings.database_url) as session:
        here = queue_status.compute_queue_snapshot(session, kept_settings)
        there = queue_status.queue_snapshot(session, kept_settings)
    assert (there.order, there.positions, there.reasons, there.queued) == (
        here.order,
        here.positions,
        here.reasons,
        here.queued,
    )


def test_sqlite_is_computed_in_the_servers_process() -> None:
    assert not queue_status.SnapshotProcess.serves(make_url("sqlite://"))
    assert not queue_status.SnapshotProcess.serves(make_url("sqlite:///:memory:"))
    assert not queue_status.SnapshotProcess.serves(make_url("sqlite:////var/phalanx/phalanx.db"))
    assert queue_status.SnapshotProcess.serves(make_url("postgresql+psycopg://db/phalanx"))


def test_a_queued_jobs_page_on_the_embedded_store_answers_at_once(tmp_path: Path) -> None:
    """The page of a job newer than the kept snapshot computes one inside its own transaction,
    which on SQLite holds the write lock: computed by another process, it waited for that lock
    until SQLite's busy timeout, 30 s."""
    settings = Settings(
        data_dir=tmp_path / "embedded",
        admin_token=ADMIN_TOKEN,
        agent_token=AGENT_TOKEN,
        queue_snapshot_seconds=KEPT_S,
    )
    upgrade(settings.database_url)
    queue_status._kept.clear()
    try:
        with TestClient(create_app(settings, enqueue=lambda *_, **__: None)) as client:
            queued = one_running_one_waiting(client, settings)
            began = time.monotonic()
            assert job(client, queued)["queue"]["position"] == 1
            assert time.monotonic() - began < 10, "the page waited for its own write lock"
    finally:
        engine_for(settings.database_url).dispose()


def test_the_snapshot_process_exits_when_its_server_is_killed(kept_settings: Settings) -> None:
    """A server killed with SIGKILL cannot shut its pool down: the process notices on its own."""
    with subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from server.queue_status import SnapshotProcess\n"
            "from server.settings import Settings\n"
            "SnapshotProcess.warm(Settings(database_url=sys.argv[1], queue_snapshot_seconds=60))\n"
            "pool = SnapshotProcess._started()\n"
            "pool.submit(int).result()\n"
            "print(*pool._processes, flush=True)\n"
            "time.sleep(600)\n",
            kept_settings.database_url,
        ],
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        assert server.stdout is not None
        (child,) = (psutil.Process(int(pid)) for pid in server.stdout.readline().split())
        assert child.is_running()
        server.kill()
        server.wait(10)
    child.wait(timeout=10 * queue_status.PARENT_CHECK_S)  # psutil.TimeoutExpired if it lived on
