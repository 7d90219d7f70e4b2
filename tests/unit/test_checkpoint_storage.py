"""Checkpoint storage is confined to the roots a cluster allows, compared after normalisation."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.checkpoints import check_storage, normalised, within
from server.errors import Unprocessable
from server.settings import Settings


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("file:///data/ckpt/", "file:///data/ckpt"),
        ("file:///data/ckpt/job-1/../../etc", "file:///data/etc"),
        ("S3://bucket/a/./b", "s3://bucket/a/b"),
        ("/no/protocol", None),
        ("http://host/x?y=1", None),
    ],
)
def test_normalised(uri: str, expected: str | None) -> None:
    assert normalised(uri) == expected


def test_within_is_a_path_prefix_not_a_string_prefix() -> None:
    assert within("file:///data/ckpt/job-1/step-1", "file:///data/ckpt")
    assert within("file:///data/ckpt", "file:///data/ckpt/")
    assert not within("file:///data/ckpt-other/x", "file:///data/ckpt")  # a string prefix only
    assert not within("file:///data/ckpt/job-1/../../../etc/passwd", "file:///data/ckpt")
    assert not within("s3://data/ckpt/x", "file:///data/ckpt")  # another protocol


def test_only_the_allowed_roots_and_their_sub_paths(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path, database_url="sqlite://", checkpoint_roots="s3://team-bucket/ckpt, file:///scratch"
    )
    for allowed in (None, f"file://{tmp_path}/checkpoints/mine", "s3://team-bucket/ckpt", "file:///scratch/a"):
        check_storage(allowed, settings)
    for refused in (
        "file:///etc",
        "http://example.com/x",
        "memory://x",
        f"file://{tmp_path}/checkpoints/../..",
        "s3://team-bucket",
    ):
        with pytest.raises(Unprocessable, match=r"checkpoint\.storage: .* is outside the checkpoint roots"):
            check_storage(refused, settings)
