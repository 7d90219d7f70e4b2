"""kombu's filesystem transport, with messages that appear whole.

The stock transport opens the message file under its final name and then writes it, so a
consumer polling the folder can read it while it is still empty, fail to decode it, and stop
the whole worker ("Unrecoverable error: JSONDecodeError", kombu issue #1551). Here the message is
written under a hidden temporary name and renamed into place: a rename is atomic.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

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


def register() -> None:
    """Make `phalanxfs://` a broker URL kombu knows."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
