"""server/inotify.py: the folder watch behind embedded wake-ups and the embedded broker."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from server.inotify import IN_CLOSE_WRITE, IN_MOVED_TO, FolderWatch, available

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux-only")


def test_available_on_linux() -> None:
    assert available()


def test_wait_times_out_when_nothing_happens(tmp_path: Path) -> None:
    watch = FolderWatch.open(tmp_path, IN_CLOSE_WRITE | IN_MOVED_TO)
    assert watch is not None
    try:
        assert watch.wait(0.05) is False
        assert watch.read_names() == set()
    finally:
        watch.close()


def test_a_write_and_a_rename_wake_the_waiter_with_their_names(tmp_path: Path) -> None:
    watch = FolderWatch.open(tmp_path, IN_CLOSE_WRITE | IN_MOVED_TO)
    assert watch is not None
    try:
        writer = threading.Timer(0.05, lambda: (tmp_path / "agent:1").write_bytes(b"x"))
        writer.start()
        assert watch.wait(10.0) is True  # returns on the event, long before the timeout
        writer.join()
        (tmp_path / ".tmp").write_bytes(b"y")
        os.replace(tmp_path / ".tmp", tmp_path / "1_abc.celery.msg")
        assert watch.read_names() == {"agent:1", ".tmp", "1_abc.celery.msg"}
        assert watch.read_names() == set()  # drained
    finally:
        watch.close()


def test_a_missing_folder_gives_no_watch(tmp_path: Path) -> None:
    assert FolderWatch.open(tmp_path / "missing", IN_MOVED_TO) is None
