"""The code bundles jobs and studies bring: a content-addressed store of .tar.gz files under the
data dir (the name is the SHA-256 of the bytes), capped in size while the upload streams in."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import BinaryIO

from server.errors import TooLarge
from server.settings import Settings


def store_bundle(settings: Settings, bundle: BinaryIO) -> tuple[str, int]:
    """Copy the upload to the content-addressed bundle store, enforcing the size cap as it streams."""
    settings.bundle_dir.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=settings.bundle_dir, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := bundle.read(1 << 20):
                size += len(chunk)
                if size > settings.max_bundle_bytes:
                    raise TooLarge(
                        f"the code bundle is over the {settings.max_bundle_bytes // 2**20} MiB cap; "
                        "keep data sets out of the job's workdir"
                    )
                digest.update(chunk)
                out.write(chunk)
        sha = digest.hexdigest()
        os.replace(tmp, settings.bundle_dir / f"{sha}.tar.gz")
        return sha, size
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
