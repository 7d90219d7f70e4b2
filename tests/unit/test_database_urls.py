"""`server.db.driver_options`: Phalanx's own options in a PostgreSQL URL become the driver's."""

from __future__ import annotations

import pytest

from server.db import driver_options, optuna_storage_options

BASE = "postgresql+psycopg://phalanx:p%40ss@db.internal:6432/phalanx"


def test_a_url_without_options_is_passed_on_unchanged() -> None:
    assert driver_options(BASE) == (BASE, {})
    sqlite = "sqlite:////tmp/x.db?prepare_threshold=none"  # SQLite's URLs are not PostgreSQL's
    assert driver_options(sqlite) == (sqlite, {})


@pytest.mark.parametrize(("value", "threshold"), [("none", None), ("off", None), ("NONE", None), ("0", 0), ("12", 12)])
def test_prepare_threshold_leaves_the_url_for_the_driver(value: str, threshold: int | None) -> None:
    url, connect_args = driver_options(f"{BASE}?sslmode=disable&prepare_threshold={value}")
    assert url == f"{BASE}?sslmode=disable"  # the password and the driver's own options kept
    assert connect_args == {"prepare_threshold": threshold}


def test_optuna_gets_the_same_url_and_options() -> None:
    url, engine_kwargs = optuna_storage_options(f"{BASE}?prepare_threshold=none")
    assert url == BASE and engine_kwargs["connect_args"] == {"prepare_threshold": None}


@pytest.mark.parametrize("value", ["five", "-1", "1.5"])
def test_a_threshold_that_is_not_a_count_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=r"prepare_threshold.*PgBouncer"):
        driver_options(f"{BASE}?prepare_threshold={value}")
