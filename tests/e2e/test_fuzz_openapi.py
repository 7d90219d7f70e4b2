"""Schemathesis over the live OpenAPI schema of a real server process (PostgreSQL, Redis): every
operation, called as a rank (its allocation's own credential), an agent, a user and an admin, with
inputs the schema allows and inputs it does not (its examples, the coverage phase's boundaries,
random fuzzing), must never get a server error.

The database holds one of everything to name (an agent, a placed job with its allocation and a
checkpoint, a study), so ids hit rows as well as miss them. Generation is deterministic
(--generation-deterministic): the same cases on every run. Each run's count of operations and cases goes to the
terminal whether the test passes or not. `schemathesis run` is driven as a user would drive it
(its pytest plugin's fixture-based loader does not run under pytest 9.2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from scheduler.service import schedule_pass
from server.db import engine_for, session_scope
from tests.conftest import ADMIN_TOKEN, AGENT_TOKEN, TABLES
from tests.processes import REPO, Stack

pytestmark = pytest.mark.e2e
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
# fuzzing cases per operation (the coverage phase adds its boundary cases); derandomized unless a
# seed is given: PHALANX_FUZZ_EXAMPLES=500 PHALANX_FUZZ_SEED=7 digs deeper by hand
MAX_EXAMPLES = int(os.environ.get("PHALANX_FUZZ_EXAMPLES", "25"))
SEED = os.environ.get("PHALANX_FUZZ_SEED")
# response_schema_conformance does not pass yet: errors answer {"error", "detail"} where the schema
# documents FastAPI's HTTPValidationError, and times are naive UTC without the offset RFC 3339 wants
CHECKS = os.environ.get("PHALANX_FUZZ_CHECKS", "not_a_server_error")
# the rank first: another principal's kill ends its allocation, and its credential with it
PRINCIPALS = ("rank", "agent", "user", "admin")


@pytest.fixture(scope="module")
def seeded(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The server alone (no scheduler, no agent process) on an emptied database, seeded."""
    with engine_for(pg_url).begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    tmp = Path(tmp_path_factory.mktemp("fuzz"))
    stack = Stack(tmp, pg_url, redis_url)
    try:
        stack.start_server()
        with httpx.Client(base_url=stack.url, timeout=30) as client:
            tokens = seed(client, pg_url, tmp / "data")
            protected = [row["id"] for row in client.get("/api/v1/tokens", headers=ADMIN).json()]
        yield {"url": stack.url, "tokens": tokens, "protected": protected, "tmp": tmp}
    finally:
        stack.close()


def seed(client: httpx.Client, database_url: str, data_dir: Path) -> dict[str, str]:
    """An agent, a placed job (its allocation, a checkpoint), a study, a plain user: their tokens."""
    body = {"name": "a0", "address": "127.0.0.1", "cpu_slots": 4}
    registered = client.post("/api/v1/agents/register", json=body, headers=AGENT).json()
    agent_id, own = registered["id"], {"Authorization": f"Bearer {registered['agent_token']}"}
    spec = '{"name": "fuzz", "entrypoint": "python t.py", "resources": {"nodes": 1}}'
    assert client.post("/api/v1/jobs", files={"spec": (None, spec)}, headers=ADMIN).status_code == 201
    with session_scope(database_url) as session:
        schedule_pass(session)
    (assignment,) = client.get(f"/api/v1/agents/{agent_id}/work", headers=own).json()["assignments"]
    path = f"file://{data_dir}/checkpoints/job-{assignment['job_id']}/step-1"
    checkpoint = client.post(
        f"/api/v1/allocations/{assignment['allocation_id']}/checkpoints",
        json={"step": 1, "path": path, "size_bytes": 1},
        headers={"Authorization": f"Bearer {assignment['credential']}"},
    )
    assert checkpoint.status_code == 201, checkpoint.text
    study = (
        '{"name": "tune", "objective": {"metric": "loss"}, "n_trials": 2, "trial": {"entrypoint": "python t.py"},'
        ' "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}}}'
    )
    assert client.post("/api/v1/studies", files={"spec": (None, study)}, headers=ADMIN).status_code == 201
    user = client.post("/api/v1/tokens", json={"kind": "user", "name": "fuzzer"}, headers=ADMIN)
    assert user.status_code == 201, user.text
    # the agent fuzzes with its own token (the cluster's only registers)
    agent = registered["agent_token"]
    return {"rank": assignment["credential"], "agent": agent, "user": user.json()["token"], "admin": ADMIN_TOKEN}


@pytest.mark.parametrize("principal", PRINCIPALS)
def test_no_input_from_any_principal_makes_a_server_error(
    seeded: dict[str, Any], principal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command = [
        str(SCHEMATHESIS),
        "--no-color",
        "run",
        f"{seeded['url']}/openapi.json",
        f"--checks={CHECKS}",
        f"--header=Authorization: Bearer {seeded['tokens'][principal]}",
        f"--max-examples={MAX_EXAMPLES}",
        *([f"--seed={SEED}"] if SEED else ["--generation-deterministic"]),
        "--phases=examples,coverage,fuzzing",
        "--workers=1",
        "--request-timeout=30",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "SCHEMATHESIS_HOOKS": "tests.e2e.fuzz_hooks",
        "PHALANX_FUZZ_PROTECTED_TOKENS": ",".join(str(i) for i in seeded["protected"]),
    }
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=seeded["tmp"], capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    operations = re.search(r"Operations:\s+(\d+) selected / (\d+) total", output)
    cases = re.search(r"^Test cases:\s*\n\s*(.+)$", output, re.MULTILINE)
    with capsys.disabled():  # in the CI log even when the test passes
        print(
            f"\nschemathesis as {principal}: {operations.group(1) if operations else '?'} operations, "
            f"{cases.group(1) if cases else '?'} ({time.monotonic() - started:.0f} s)"
        )
    assert done.returncode == 0, output[-20_000:]
    assert operations and cases and operations.group(1) == operations.group(2), output[-5_000:]
