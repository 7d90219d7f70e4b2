"""What a code bundle (.tar.gz) may hold, checked while it streams: on the server at upload and
again on the agent while it unpacks, so neither ever trusts the other.

A bundle holds regular files and folders under one root, and links that stay inside it; never an
absolute path, a `..` that climbs out, a device, a fifo or a sparse file. Its number of entries,
the bytes it unpacks to and its path lengths are capped. Members are read one by one (tarfile's
stream mode): a bundle of a million empty files or a decompression bomb is refused after reading
at most one cap's worth, never held in memory. Standard library only: the agent imports it.
"""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_UNPACKED_BYTES = 1 << 30
MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 255


class BundleRefused(ValueError):
    """The bundle breaks a limit; the message names it and what to do."""


@dataclass(frozen=True, slots=True)
class BundleLimits:
    max_files: int = DEFAULT_MAX_FILES
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES


def _inside(path: str) -> bool:
    return not path.startswith("/") and path != ".." and not path.startswith("../")


def _check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if len(name) > MAX_PATH_CHARS or any(len(part) > MAX_NAME_CHARS for part in name.split("/")):
        raise BundleRefused(
            f"the bundle has a path longer than {MAX_PATH_CHARS} characters (or a name longer than "
            f"{MAX_NAME_CHARS}): {name[:80]!r}…"
        )
    if "\0" in name or not _inside(posixpath.normpath(name)) or name.startswith("/"):
        raise BundleRefused(f"the bundle has an entry outside its folder ({name[:200]!r}); pack the workdir's contents")
    if member.issym():
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
        if member.linkname.startswith("/") or not _inside(target):
            raise BundleRefused(
                f"the bundle's symbolic link {name[:200]!r} points outside it ({member.linkname[:200]!r})"
            )
    elif member.islnk():
        if member.linkname.startswith("/") or not _inside(posixpath.normpath(member.linkname)):
            raise BundleRefused(f"the bundle's hard link {name[:200]!r} points outside it ({member.linkname[:200]!r})")
    elif member.issparse() or not (member.isfile() or member.isdir()):
        raise BundleRefused(
            f"the bundle's entry {name[:200]!r} is not a plain file, folder or link (a device, fifo or sparse "
            "file); leave it out"
        )


def checked_members(tar: tarfile.TarFile, limits: BundleLimits) -> Iterator[tarfile.TarInfo]:
    """The members of a tar opened in stream mode, each checked before its data is read; raises
    `BundleRefused` at the first one past a limit."""
    unpacked = 0
    for files, member in enumerate(tar, start=1):
        if files > limits.max_files:
            raise BundleRefused(
                f"the bundle has more than {limits.max_files} files; leave data sets and build outputs out of the "
                "workdir (read them from shared storage)"
            )
        _check_member(member)
        unpacked += member.size if member.isfile() else 0
        if unpacked > limits.max_unpacked_bytes:
            raise BundleRefused(
                f"the bundle unpacks to more than {limits.max_unpacked_bytes >> 20} MiB; leave data sets out of "
                "the workdir (read them from shared storage)"
            )
        yield member
        tar.members.clear()  # type: ignore[attr-defined]  # stream mode keeps every member it saw


def _open(source: IO[bytes]) -> tarfile.TarFile:
    return tarfile.open(fileobj=source, mode="r|gz")


def check_bundle(source: IO[bytes], limits: BundleLimits) -> int:
    """Read the whole bundle through the checks (its data is read, not kept); the number of entries.
    Raises `BundleRefused`, also for a file that is not a readable .tar.gz."""
    try:
        with _open(source) as tar:
            return sum(1 for _ in checked_members(tar, limits))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleRefused(
            f"the bundle is not a readable .tar.gz ({exc}); pack it with `tar czf code.tar.gz -C workdir .`"
        ) from exc


def extract_bundle(source: IO[bytes], destination: Path, limits: BundleLimits) -> int:
    """Unpack into `destination`, each member checked before it is written (and tarfile's "data"
    filter on top); the number of entries. Raises `BundleRefused`."""
    try:
        with _open(source) as tar:
            count = 0
            for member in checked_members(tar, limits):
                tar.extract(member, destination, filter="data")
                count += 1
            return count
    except tarfile.FilterError as exc:
        raise BundleRefused(f"the bundle was refused while unpacking: {exc}") from exc
    except (tarfile.TarError, EOFError) as exc:
        raise BundleRefused(f"the bundle is not a readable .tar.gz ({exc})") from exc
