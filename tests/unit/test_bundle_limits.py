"""Hostile bundles are refused while they stream, before anything lands outside the destination:
zip-slip, absolute paths, links out of the tree, devices, a million empty files, a decompression
bomb. (The server's upload route and the agent both use these checks; see
tests/integration/test_hostile_input.py for the route.)"""

from __future__ import annotations

import gzip
import io
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from phalanx.bundle_limits import BundleLimits, BundleRefused, check_bundle, extract_bundle

LIMITS = BundleLimits()


def tar_gz(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buffer.seek(0)
    return buffer


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def test_a_plain_bundle_unpacks(tmp_path: Path) -> None:
    bundle = tar_gz(
        (entry("./train.py"), b"print(1)\n"),
        (entry("./lib", tarfile.DIRTYPE), None),
        (entry("./lib/util.py"), b"X = 1\n"),
        (entry("./latest.py", tarfile.SYMTYPE, "lib/util.py"), None),  # a link inside the tree is fine
    )
    assert extract_bundle(bundle, tmp_path, LIMITS) == 4
    assert (tmp_path / "lib" / "util.py").read_text() == "X = 1\n"
    assert (tmp_path / "latest.py").read_text() == "X = 1\n"


@pytest.mark.parametrize(
    ("member", "problem"),
    [
        ((entry("../../escaped.py"), b"x"), "outside its folder"),
        ((entry("./a/../../escaped.py"), b"x"), "outside its folder"),
        ((entry("/tmp/absolute.py"), b"x"), "outside its folder"),
        ((entry("./passwd", tarfile.SYMTYPE, "/etc/passwd"), None), "symbolic link"),
        ((entry("./up", tarfile.SYMTYPE, "../../.."), None), "symbolic link"),
        ((entry("./hard", tarfile.LNKTYPE, "../../etc/passwd"), None), "hard link"),
        ((entry("./hard", tarfile.LNKTYPE, "/etc/passwd"), None), "hard link"),
        ((entry("./null", tarfile.CHRTYPE), None), "not a plain file"),
        ((entry("./disk", tarfile.BLKTYPE), None), "not a plain file"),
        ((entry("./pipe", tarfile.FIFOTYPE), None), "not a plain file"),
        ((entry("./" + "d" * 300), b"x"), "longer than"),
        ((entry("./" + "/".join(["d" * 200] * 6)), b"x"), "longer than"),
    ],
)
def test_a_hostile_entry_is_refused_and_nothing_lands_outside(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None], problem: str
) -> None:
    inside = tmp_path / "a" / "b" / "dest"
    inside.mkdir(parents=True)
    bundle = tar_gz((entry("./ok.py"), b"ok"), member)
    with pytest.raises(BundleRefused, match=problem):
        check_bundle(bundle, LIMITS)
    bundle.seek(0)
    with pytest.raises(BundleRefused, match=problem):
        extract_bundle(bundle, inside, LIMITS)
    outside = {p for p in tmp_path.rglob("*") if inside not in (p, *p.parents)}
    assert outside == {tmp_path / "a", tmp_path / "a" / "b"}  # nothing written beside the destination


def million_empty_files() -> io.BytesIO:
    """1,000,000 entries of an empty file (one header repeated: gzip makes it ~1 MiB)."""
    header = entry("./empty").tobuf(format=tarfile.USTAR_FORMAT)
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as gz:
        block = header * 10_000
        for _ in range(100):
            gz.write(block)
        gz.write(b"\0" * 1024)
    out.seek(0)
    return out


def test_a_million_empty_files_are_refused_at_the_cap_fast_and_in_bounded_memory() -> None:
    bundle = million_empty_files()
    assert len(bundle.getbuffer()) < 8 << 20
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(BundleRefused, match="more than 10000 files"):
            check_bundle(bundle, LIMITS)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 5.0 and peak < 32 << 20, (elapsed, peak)


def bomb(unpacked: int) -> io.BytesIO:
    """One file of `unpacked` zero bytes: gzip shrinks it a thousandfold."""
    info = entry("./zeros")
    info.size = unpacked
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as gz:
        gz.write(info.tobuf(format=tarfile.USTAR_FORMAT))
        chunk = b"\0" * (1 << 20)
        for _ in range(unpacked >> 20):
            gz.write(chunk)
        gz.write(b"\0" * 1024)
    out.seek(0)
    return out


def test_a_decompression_bomb_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    limits = BundleLimits(max_unpacked_bytes=64 << 20)
    bundle = bomb(256 << 20)
    assert len(bundle.getbuffer()) < 2 << 20
    started = time.perf_counter()
    with pytest.raises(BundleRefused, match="unpacks to more than 64 MiB"):
        extract_bundle(bundle, tmp_path, limits)
    assert time.perf_counter() - started < 2.0
    assert list(tmp_path.iterdir()) == []  # refused from its header: not a byte written


def test_something_that_is_not_a_tar_gz_is_refused() -> None:
    with pytest.raises(BundleRefused, match=r"not a readable \.tar\.gz"):
        check_bundle(io.BytesIO(b"PK\x03\x04 a zip, say"), LIMITS)
    with pytest.raises(BundleRefused, match=r"not a readable \.tar\.gz"):
        check_bundle(io.BytesIO(b"\x1f\x8b\x08\x00" + b"not deflate at all" * 10), LIMITS)
