"""kombu's filesystem transport, with messages that appear whole.

The stock transport opens the message file under its final name and then writes it, so a
consumer polling the folder can read it while it is still empty, fail to decode it, and stop
the whole worker ("Unrecoverable error: JSONDecodeError", kombu issue #1551). Here the message is
written under a hidden temporary name and renamed into place: a rename is atomic.

A consumer also sleeps differently: instead of listing the folder every `polling_interval`, it
waits on an inotify watch for the next rename into the folder, so an idle worker costs no CPU and
a new message is picked up at once; `polling_interval` only bounds the wait (and is the poll
period where inotify is missing).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic, sleep
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

from server.inotify import IN_MOVED_TO, FolderWatch

SCHEME = "phalanxfs"


class Channel(filesystem.Channel):
    # kombu's own bases disagree on _put's signature; this one keeps the filesystem channel's
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, f".{uuid.uuid4().hex}.tmp")  # never matches *.msg
        try:
            with open(temporary, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(temporary, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel

    _watch: FolderWatch | None = None
    _watch_opened = False

    def _folder_watch(self) -> FolderWatch | None:
        if not self._watch_opened:
            self._watch_opened = True
            options = self.client.transport_options if self.client is not None else {}
            folder = options.get("data_folder_in")
            if folder:
                self._watch = FolderWatch.open(Path(folder), IN_MOVED_TO)
        return self._watch

    # kombu's own bases disagree on the signature; this one keeps the virtual transport's
    def drain_events(self, connection: Any, timeout: Any = None) -> Any:  # type: ignore[override]
        """kombu's loop (virtual.Transport.drain_events), with the sleep replaced by a watch."""
        cycle = self.cycle
        assert cycle is not None, "the transport has no channel cycle before its first channel"
        started = monotonic()
        watch = self._folder_watch()
        while True:
            if watch is not None:
                watch.read_names()  # forget what was queued: the folder is listed right after
            try:
                cycle.get(self._deliver, timeout=timeout)  # type: ignore[no-untyped-call]
                return
            except Empty:
                waited = monotonic() - started
                if timeout is not None and waited >= timeout:
                    raise TimeoutError() from None
                pause = self.polling_interval or 0.0
                if timeout is not None:
                    pause = min(pause, timeout - waited)
                if watch is not None:
                    watch.wait(pause)
                else:
                    sleep(pause)

    def close_connection(self, connection: Any) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch, self._watch_opened = None, False
        super().close_connection(connection)  # type: ignore[no-untyped-call]


def register() -> None:
    """Make `phalanxfs://` a broker URL kombu knows."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
