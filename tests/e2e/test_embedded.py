"""The embedded default: `phalanx demo --once` on SQLite and the filesystem broker, no services."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.processes import PHALANX, free_port, processes_with_env

pytestmark = pytest.mark.e2e


def test_demo_once_runs_the_example_to_completion(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    done = subprocess.run(
        [*PHALANX, "demo", "--once", "--port", str(free_port()), "--data-dir", str(tmp_path / "data")],
        env={**env, "COLUMNS": "120"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "admin token:" in done.stdout
    assert "COMPLETED" in done.stdout
    assert (tmp_path / "data" / "phalanx.db").exists()
    # nothing of the stack (server, scheduler, agents, workers) outlives the command
    assert processes_with_env("PHALANX_DATA_DIR", str((tmp_path / "data").resolve())) == []
