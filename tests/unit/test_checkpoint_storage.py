"""Checkpoint storage is confined to the roots a cluster allows, compared after normalisation; retention
ranks by finite values only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from phalanx.schemas import CheckpointPolicy
from server.checkpoints import check_storage, normalised, to_keep, within
from server.errors import Unprocessable
from server.models import Checkpoint
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


@pytest.mark.parametrize(("mode", "best"), [("min", 2), ("max", 3)])
def test_retention_never_ranks_a_nan_or_infinite_metric_best(mode: str, best: int) -> None:
    def row(step: int, loss: float) -> Checkpoint:
        return Checkpoint(id=step, step=step, metrics={"loss": loss})

    rows = [row(1, math.nan), row(2, 0.5), row(3, 0.9), row(4, -math.inf), row(5, math.inf), row(6, 0.7)]
    policy = CheckpointPolicy(keep_last=1, keep_best=1, metric="loss", mode=mode)  # type: ignore[arg-type]
    assert to_keep(rows, policy) == {6, best}
