"""Fair sharing's decayed usage summed by the database agrees with the same sum in Python, on
PostgreSQL and on the embedded SQLite, whatever the nodes' intervals: open, ended, outside the
window, placed after the pass began, of many slots, of no team, running for thousands of
half-lives."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from server import sharing
from server.db import engine_for, upgrade
from server.models import Agent, Allocation, AllocationNode, Job, Team, User
from server.settings import Settings
from server.transitions import db_now

HALF_LIFE_S = 3600.0


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest, settings: Settings, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database of each kind (its URL)."""
    if request.param == "postgresql":
        yield settings.database_url
        return
    url = Settings(data_dir=tmp_path / "embedded").database_url
    upgrade(url)
    yield url
    engine_for(url).dispose()


def node(session: Session, job: Job, placed: datetime, ended: datetime | None, slots: int, slot_type: str) -> None:
    allocation = Allocation(job=job, attempt=len(job.allocations) + 1, master_addr="h", created_at=placed)
    allocation.nodes.append(
        AllocationNode(
            node_rank=0,
            agent_id=1,
            slot_type=slot_type,
            slot_indices=list(range(slots)),
            state="EXITED" if ended else "RUNNING",
            ended_at=ended,
        )
    )
    session.add(allocation)


def test_the_database_sums_decayed_usage_as_python_does(store: str) -> None:
    hour = timedelta(hours=1)
    with Session(engine_for(store)) as session, session.begin():
        now = db_now(session)
        owner = User(name="u", is_admin=False)
        teams = [Team(name="ml"), Team(name="vision")]
        session.add_all([owner, *teams, Agent(name="a", address="h", state="ACTIVE", cpu_slots=8)])
        session.flush()

        def job(team: Team | None) -> Job:
            spec = {"name": "j", "entrypoint": "x"}
            row = Job(
                name="j", owner_id=owner.id, team_id=None if team is None else team.id, state="RUNNING", spec=spec
            )
            row.priority, row.nodes, row.slots_per_node, row.slot_type = 50, 1, 1, "cpu"
            session.add(row)
            return row

        ml, vision, own = job(teams[0]), job(teams[1]), job(None)
        node(session, ml, now - 2 * hour, now - hour, 4, "cpu")  # ended an hour ago
        node(session, ml, now - timedelta(minutes=30), None, 2, "cpu")  # running
        node(session, ml, now - 3 * hour, now - 2 * hour, 1, "gpu")
        node(session, vision, now - 12 * hour, now - 11 * hour, 8, "cpu")  # before the window: not read
        node(session, vision, now - 2000 * hour, None, 1, "cpu")  # running for 2,000 half-lives
        node(session, vision, now + hour, None, 3, "cpu")  # placed after this pass's clock: not read
        node(session, own, now - hour, now + timedelta(seconds=5), 2, "cpu")  # its end stamped later
        session.flush()

        in_python = sharing.decayed_usage(
            sharing.slot_intervals(session, now - sharing.HALF_LIVES_READ * hour, now), now, HALF_LIFE_S
        )
        in_database = sharing.decayed_usage_in_database(session, now, HALF_LIFE_S)
    assert in_database.keys() == in_python.keys() == {("ml", "cpu"), ("ml", "gpu"), ("vision", "cpu"), ("", "cpu")}
    for key, usage in in_python.items():
        # SQLite's julianday keeps times to ~50 microseconds
        assert in_database[key] == pytest.approx(usage, rel=1e-6), key
    assert in_database[("vision", "cpu")] == pytest.approx(1.0)  # a slot held forever counts one slot
