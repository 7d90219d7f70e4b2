"""Linux inotify on one folder, through libc: wait for files to appear or change without polling.

The embedded mode has no Redis, so its wake-ups and its Celery broker are files. Polling those
folders every few milliseconds costs CPU that training on the same cores would otherwise get
(measured: see bench/RESULTS.md, "control-plane CPU"); an inotify descriptor costs nothing while
nothing happens. Where inotify is missing (not Linux, or the watch limit is reached)
`FolderWatch.open` returns None and callers keep polling.

Contract: one watch per folder per process; events arrive for names directly in the folder;
`read_names` drains what is queued and never blocks. Not thread-safe: one thread reads a watch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import struct
import sys
from pathlib import Path

log = logging.getLogger(__name__)

IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1  # noqa: B018 - raises AttributeError where the call does not exist
    except (OSError, AttributeError):
        return None
    return libc


def available() -> bool:
    return _libc() is not None


class FolderWatch:
    """An inotify descriptor watching one folder for the given event mask."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def open(cls, folder: Path, mask: int) -> FolderWatch | None:
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.info("inotify unavailable (%s); polling %s instead", os.strerror(ctypes.get_errno()), folder)
            return None
        if libc.inotify_add_watch(fd, os.fsencode(folder), mask) < 0:
            log.info("cannot watch %s (%s); polling instead", folder, os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
        return cls(fd)

    def fileno(self) -> int:
        return self._fd

    def wait(self, timeout: float) -> bool:
        """Block until an event is queued or `timeout` seconds pass; True when one is queued."""
        ready, _, _ = select.select([self._fd], [], [], max(timeout, 0.0))
        return bool(ready)

    def read_names(self) -> set[str]:
        """The names of every queued event (drains the queue; empty when none is queued)."""
        names: set[str] = set()
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return names
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, _, _, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                names.add(data[start : start + length].rstrip(b"\0").decode(errors="replace"))
                offset = start + length

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
