"""The code bundles jobs and studies bring: a content-addressed store of .tar.gz files under the
data dir (the name is the SHA-256 of the bytes), capped in size while the upload streams in, and
checked entry by entry before it is kept (`phalanx.bundle_limits`: file count, unpacked size,
paths, links, devices; the agents check again while unpacking)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import BinaryIO

from phalanx.bundle_limits import BundleLimits, BundleRefused, check_bundle
from server.errors import TooLarge, Unprocessable
from server.settings import Settings


def bundle_limits(settings: Settings) -> BundleLimits:
    return BundleLimits(settings.max_bundle_files, settings.max_bundle_unpacked_bytes)


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
        with open(tmp, "rb") as written:
            try:
                check_bundle(written, bundle_limits(settings))
            except BundleRefused as exc:
                raise Unprocessable(f"bundle: {exc}") from exc
        sha = digest.hexdigest()
        os.replace(tmp, settings.bundle_dir / f"{sha}.tar.gz")
        return sha, size
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
