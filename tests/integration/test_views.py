"""`server.views` on a real PostgreSQL: a list of rows costs the same number of statements
whatever its length (no query per row), and the batched views say what the rows hold."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from phalanx.schemas import AgentState, JobSpec, JobState, StudySpec
from server import jobs, studies, views
from server.db import session_factory, session_scope
from server.models import Agent, Allocation, AllocationNode, Job, SlotLease, TuningStudy, TuningTrial, User
from server.settings import Settings
from tests.statements import counting

pytestmark = pytest.mark.integration
ROWS = 50


def statements(url: str, load: Callable[[Session], Sequence[Any]], convert: Callable[[Session, Any], object]) -> int:
    """Statements that `convert` sends for the rows that `load` reads (in a fresh session)."""
    with session_factory(url)() as session, session.begin():
        rows = load(session)
        with counting(url) as seen:
            convert(session, rows)
    return seen.count


@pytest.fixture
def populated(clean_db: str) -> str:
    """Two users; ROWS agents, ROWS jobs (attempts with metrics, the even ones restarted once, the
    first ROWS // 2 holding a slot each) and ROWS studies of two trials (their jobs are jobs too)."""
    spec = JobSpec.model_validate({"name": "j", "entrypoint": "python t.py", "resources": {"nodes": 1}})
    study_spec = StudySpec.model_validate(
        {
            "name": "tune",
            "objective": {"metric": "loss"},
            "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "n_trials": 4,
            "trial": {"entrypoint": "python t.py"},
        }
    )
    with session_scope(clean_db) as session:
        owners = [User(name="alice"), User(name="bob")]
        agents = [
            Agent(name=f"a{i}", address="127.0.0.1", state=AgentState.ACTIVE.value, cpu_slots=2) for i in range(ROWS)
        ]
        session.add_all([*owners, *agents])
        session.flush()
        for i in range(ROWS):
            job = jobs.create_job(session, spec, owners[i % 2].id, None, 0)
            first = Allocation(
                job_id=job.id,
                attempt=1,
                master_addr="127.0.0.1",
                latest_metrics={"loss": 2.0, "acc": 0.5},
                latest_step=10,
            )
            session.add(first)
            if i % 2 == 0:
                session.add(
                    Allocation(
                        job_id=job.id, attempt=2, master_addr="127.0.0.1", latest_metrics={"loss": 1.0}, latest_step=20
                    )
                )
            if i < ROWS // 2:
                session.flush()
                node = AllocationNode(
                    allocation_id=first.id,
                    node_rank=0,
                    agent_id=agents[i].id,
                    slot_type="cpu",
                    slot_indices=[0],
                    state="RUNNING",
                )
                session.add(node)
                session.flush()
                session.add(SlotLease(agent_id=agents[i].id, slot_type="cpu", slot_index=0, node_id=node.id))
        for i in range(ROWS):
            study = studies.create_study(session, study_spec, owners[i % 2].id, None, 0)
            for number in range(2):
                studies.create_trial(session, study, number, 1000 * study.id + number, {"x": number / 2})
    return clean_db


def every_job(session: Session) -> Sequence[views.JobRow]:
    return session.execute(views.job_rows().order_by(Job.id)).all()


def test_listing_jobs_costs_the_same_statements_for_one_row_or_many(populated: str) -> None:
    def first(n: int) -> Callable[[Session], Sequence[views.JobRow]]:
        return lambda session: every_job(session)[:n]

    def read(session: Session, query: Any) -> object:
        return session.execute(query).all()

    # the rows themselves, their owners and trials with them: one statement, whatever their number
    for query in (views.job_rows().order_by(Job.id).limit(1), views.job_rows().order_by(Job.id)):
        assert statements(populated, lambda _, query=query: query, read) == 1
    for latest in (True, False):

        def convert(session: Session, rows: Sequence[views.JobRow], latest: bool = latest) -> object:
            return views.jobs(session, rows, latest=latest)

        assert statements(populated, first(1), convert) == statements(populated, first(3 * ROWS), convert)
    assert statements(populated, first(3 * ROWS), views.jobs) == 1  # the newest metrics
    assert statements(populated, first(3 * ROWS), lambda s, rows: views.jobs(s, rows, latest=False)) == 0
    assert statements(populated, first(0), views.jobs) == 0


def test_batched_job_views_match_each_row(populated: str) -> None:
    with session_factory(populated)() as session, session.begin():
        rows = every_job(session)
        listed = views.jobs(session, rows)
        assert listed == [views.job(session, row.id) for row in rows]
        assert views.jobs(session, rows, latest=False) == [views.job(session, row.id, latest=False) for row in rows]
        trial_jobs = {
            job_id: (study_id, number)
            for study_id, number, job_id in session.execute(
                select(TuningTrial.study_id, TuningTrial.number, TuningTrial.job_id)
            )
        }
    assert [view.id for view in listed] == [row.id for row in rows]
    for i, view in enumerate(listed[:ROWS]):  # the plain jobs: the newest attempt's values win
        assert view.owner == ("alice", "bob")[i % 2]
        assert view.state is JobState.QUEUED
        if i % 2 == 0:
            assert (view.latest_metrics, view.latest_step) == ({"loss": 1.0, "acc": 0.5}, 20)
        else:
            assert (view.latest_metrics, view.latest_step) == ({"loss": 2.0, "acc": 0.5}, 10)
        assert (view.study_id, view.trial_number) == (None, None)
    for view in listed[ROWS:]:  # the trials' jobs
        assert (view.latest_metrics, view.latest_step) == ({}, None)
        assert (view.study_id, view.trial_number) == trial_jobs[view.id]
    assert len(trial_jobs) == 2 * ROWS


def every_study(session: Session) -> list[TuningStudy]:
    return list(session.scalars(select(TuningStudy).order_by(TuningStudy.id)))


def test_listing_studies_costs_the_same_statements_for_one_row_or_many(populated: str) -> None:
    for convert in (views.studies, views.study_details):
        assert statements(populated, lambda s: every_study(s)[:1], convert) == statements(
            populated, every_study, convert
        )
    with_owners = select(TuningStudy).options(selectinload(TuningStudy.owner))
    assert statements(populated, lambda s: list(s.scalars(with_owners)), views.studies) == 1  # the trials
    with session_factory(populated)() as session, session.begin():
        rows = every_study(session)
        listed = views.studies(session, rows)
        assert listed == [views.study(session, row) for row in rows]
        assert views.study_details(session, rows) == [views.study_detail(session, row) for row in rows]
    assert [s.owner for s in listed] == [("alice", "bob")[i % 2] for i in range(ROWS)]
    assert all(s.trial_counts == {"RUNNING": 2} for s in listed)


def test_listing_agents_costs_the_same_statements_for_one_row_or_many(populated: str) -> None:
    def every_agent(session: Session) -> list[Agent]:
        return list(session.scalars(select(Agent).order_by(Agent.id)))

    assert statements(populated, lambda s: every_agent(s)[:1], views.agents) == 1
    assert statements(populated, every_agent, views.agents) == 1
    with session_factory(populated)() as session, session.begin():
        listed = views.agents(session, every_agent(session))
        # rows of columns, as the REST list reads them, and a page with gaps: the leases of the
        # agents between its ids (agents 1, 3, ... hold one each) are not counted
        columns = session.execute(select(*views.AGENT_VIEW_COLUMNS).order_by(Agent.id)).all()
        assert views.agents(session, columns) == listed
        every_other = views.agents(session, columns[: ROWS // 2 : 2] + columns[ROWS // 2 :: 2])
    assert [a.used_cpu_slots for a in listed] == [1] * (ROWS // 2) + [0] * (ROWS - ROWS // 2)
    assert [a.id for a in every_other] == [a.id for a in listed[: ROWS // 2 : 2] + listed[ROWS // 2 :: 2]]
    assert [a.used_cpu_slots for a in every_other] == [1] * len(listed[: ROWS // 2 : 2]) + [0] * len(
        listed[ROWS // 2 :: 2]
    )


def test_a_stored_spec_is_validated_once_unless_it_is_too_long_to_keep() -> None:
    short = JobSpec.model_validate({"name": "j", "entrypoint": "python t.py"}).model_dump_json()
    assert views.stored_spec(short) is views.stored_spec(short)
    long = JobSpec.model_validate(
        {"name": "j", "entrypoint": "python t.py", "env": {f"V{i}": "x" * 100 for i in range(200)}}
    ).model_dump_json()
    assert len(long) > views.MAX_KEPT_SPEC_CHARS
    assert views.stored_spec(long) is not views.stored_spec(long)
    assert views.stored_spec(long) == JobSpec.model_validate_json(long)


def test_a_jobs_detail_shows_the_same_latest_metrics_as_its_row_in_a_list(populated: str, settings: Settings) -> None:
    with session_factory(populated)() as session, session.begin():
        listed = views.jobs(session, every_job(session))
        for view in listed:
            row = session.scalars(select(Job).where(Job.id == view.id).options(*views.JOB_DETAIL_LOADS)).one()
            detail = views.job_detail(session, row, settings)
            assert (detail.latest_metrics, detail.latest_step) == (view.latest_metrics, view.latest_step)
    assert any(view.latest_metrics for view in listed)
