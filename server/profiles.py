"""On-demand profiles: the rules of asking a running attempt's ranks to record torch.profiler
traces, of taking each rank's trace, and of keeping them.

- A profile belongs to one attempt (allocation). It is asked for while the job runs, and only one
  at a time per attempt: `Allocation.profile_request` holds it, and every metric batch's answer
  carries it to the ranks (`MetricBatchAnswer`), so the request needs no channel of its own.
- Each rank records its next `steps` optimizer steps and sends its gzipped trace (or why it could
  not) once; the first answer per rank stands, a retry is a no-op. Once every rank has answered,
  the request is cleared (compare-and-set on the id, so a newer request is never cleared).
- The trace is summarised as it is accepted (`server.trace_summary`); an upload that is no trace
  is refused (422) and changes nothing.
- Traces live under `<data_dir>/profiles/<job>/<profile>/`, each under a name of its own (two
  uploads racing never write one file). A job keeps its newest `MAX_PROFILES_PER_JOB`; the files
  of older ones, and of deleted ones, are removed after the commit that dropped their rows.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, selectinload

from phalanx import schemas
from server.attempts import RUNNING_STATES, active_allocation
from server.errors import Conflict, NotFound, Unprocessable
from server.models import Allocation, Job, Profile, ProfileTrace, User, utcnow
from server.settings import Settings
from server.trace_summary import TraceRefused, summarise_bytes

MAX_PROFILES_PER_JOB = 5


def profile_dir(settings: Settings, job_id: int, profile_id: int) -> Path:
    return settings.data_dir / "profiles" / str(job_id) / str(profile_id)


def request_profile(session: Session, job: Job, steps: int, user_id: int | None) -> tuple[Profile, list[int]]:
    """Ask the running attempt of `job` (locked) for a profile of `steps` steps. Returns it and the
    ids of the older profiles it pushed out (their files go after the commit: `remove_files`)."""
    if job.state not in RUNNING_STATES:
        raise Conflict(f"job {job.id} is {job.state}: a profile records a running attempt; ask once it runs")
    allocation = active_allocation(session, job.id)
    if allocation is None or allocation.fenced:
        raise Conflict(f"job {job.id} has no attempt running just now; ask again once it restarted")
    if allocation.profile_request is not None:
        raise Conflict(
            f"profile {allocation.profile_request} of job {job.id} is still recording; wait for it "
            f"(`phalanx jobs profile {job.id} --show {allocation.profile_request}`) or delete it"
        )
    spec = schemas.JobSpec.model_validate(job.spec)
    profile = Profile(
        job_id=job.id,
        allocation_id=allocation.id,
        steps=steps,
        world_size=spec.resources.world_size,
        requested_by=user_id,
    )
    session.add(profile)
    session.flush()
    asked = session.execute(
        update(Allocation)
        .where(Allocation.id == allocation.id, Allocation.profile_request.is_(None))
        .values(profile_request=profile.id)
    )
    if asked.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"another profile of job {job.id} was asked for at the same moment; wait for it")
    older = list(
        session.scalars(
            select(Profile.id).where(Profile.job_id == job.id).order_by(Profile.id.desc()).offset(MAX_PROFILES_PER_JOB)
        )
    )
    for profile_id in older:
        session.delete(session.get_one(Profile, profile_id))
    return profile, older


def delete_profile(session: Session, profile: Profile) -> None:
    """Drop the profile (its files go after the commit); a request still pending is withdrawn."""
    session.execute(
        update(Allocation)
        .where(Allocation.id == profile.allocation_id, Allocation.profile_request == profile.id)
        .values(profile_request=None)
    )
    session.delete(profile)


def remove_files(settings: Settings, job_id: int, profile_ids: list[int]) -> None:
    for profile_id in profile_ids:
        shutil.rmtree(profile_dir(settings, job_id, profile_id), ignore_errors=True)


def get_profile(session: Session, job_id: int, profile_id: int) -> Profile:
    profile = session.get(Profile, profile_id)
    if profile is None or profile.job_id != job_id:
        raise NotFound(f"job {job_id} has no profile {profile_id}; `phalanx jobs show {job_id}` lists its profiles")
    return profile


def profile_for_rank(session: Session, allocation_id: int, profile_id: int, rank: int) -> Profile:
    profile = session.get(Profile, profile_id)
    if profile is None or profile.allocation_id != allocation_id:
        raise NotFound(f"allocation {allocation_id} was asked for no profile {profile_id}")
    if not 0 <= rank < profile.world_size:
        raise Unprocessable(f"rank {rank} is not in this attempt: its ranks are 0 to {profile.world_size - 1}")
    return profile


def summarise_upload(trace: bytes) -> schemas.TraceSummary:
    try:
        return summarise_bytes(trace)
    except TraceRefused as exc:
        raise Unprocessable(f"rank trace refused: {exc}") from exc


def write_trace(settings: Settings, job_id: int, profile_id: int, rank: int, trace: bytes) -> str:
    """The trace under a name of its own (relative to the data dir), written whole before use."""
    folder = profile_dir(settings, job_id, profile_id)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"rank-{rank}-{secrets.token_hex(4)}.json.gz"
    partial = folder / f".{name}.part"
    partial.write_bytes(trace)
    os.replace(partial, folder / name)
    return str((folder / name).relative_to(settings.data_dir))


def record_answer(
    session: Session,
    profile: Profile,
    rank: int,
    *,
    path: str | None = None,
    size_bytes: int = 0,
    summary: schemas.TraceSummary | None = None,
    error: str | None = None,
) -> bool:
    """Store a rank's trace (or its error); False when the rank had answered already (the first
    answer stands). Once every rank has, the attempt's request is cleared. The profile's row lock
    orders the answers: two last answers racing would each count the other's as missing, and
    leave the request standing."""
    session.refresh(profile, with_for_update=True)
    make = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stored = session.execute(
        make(ProfileTrace)
        .values(
            profile_id=profile.id,
            rank=rank,
            path=path,
            size_bytes=size_bytes,
            summary=summary.model_dump(mode="json") if summary is not None else None,
            error=error,
            created_at=utcnow(),
        )
        .on_conflict_do_nothing()
        .returning(ProfileTrace.rank)
    ).first()
    if stored is None:  # two answers racing: the primary key lets one in
        return False
    answered = session.scalar(
        select(func.count()).select_from(ProfileTrace).where(ProfileTrace.profile_id == profile.id)
    )
    if answered is not None and answered >= profile.world_size:
        session.execute(
            update(Allocation)
            .where(Allocation.id == profile.allocation_id, Allocation.profile_request == profile.id)
            .values(profile_request=None)
        )
    return True


def trace_path(settings: Settings, profile: Profile, rank: int, session: Session) -> Path:
    row = session.get(ProfileTrace, (profile.id, rank))
    if row is None or row.path is None:
        why = row.error if row is not None and row.error else "it has not sent one yet"
        raise NotFound(f"rank {rank} of profile {profile.id} has no trace: {why}")
    return settings.data_dir / row.path


# --- views --------------------------------------------------------------------------------------


def view(session: Session, profile: Profile) -> schemas.ProfileView:
    return views(session, [profile])[0]


def views(session: Session, profiles: list[Profile]) -> list[schemas.ProfileView]:
    if not profiles:
        return []
    allocations = {
        row.id: row
        for row in session.execute(
            select(Allocation.id, Allocation.attempt, Allocation.active, Allocation.profile_request).where(
                Allocation.id.in_({p.allocation_id for p in profiles})
            )
        )
    }
    requesters = {p.requested_by for p in profiles if p.requested_by is not None}
    names = {
        user_id: name for user_id, name in session.execute(select(User.id, User.name).where(User.id.in_(requesters)))
    }
    out = []
    for profile in profiles:
        allocation = allocations[profile.allocation_id]
        ranks = [
            schemas.RankProfile(
                rank=trace.rank,
                size_bytes=trace.size_bytes,
                summary=schemas.TraceSummary.model_validate(trace.summary) if trace.summary else None,
                error=trace.error,
            )
            for trace in profile.traces
        ]
        if len(ranks) >= profile.world_size:
            state: schemas.ProfileState = "complete"
        elif allocation.active and allocation.profile_request == profile.id:
            state = "recording"
        else:
            state = "incomplete"
        summaries = [(r.rank, r.summary) for r in ranks if r.summary is not None]
        step_time = comm_fraction = None
        slowest = None
        if summaries:
            step_time = statistics.median(s.step_time_s for _, s in summaries)
            exposed = statistics.median(s.exposed_comm_s for _, s in summaries)
            comm_fraction = exposed / step_time if step_time > 0 else 0.0
            # a rank's own work is its step less the communication it waited for (the others wait
            # for the slowest in theirs); ties go to the lowest rank
            slowest = max(summaries, key=lambda item: (item[1].step_time_s - item[1].exposed_comm_s, -item[0]))[0]
        out.append(
            schemas.ProfileView(
                id=profile.id,
                job_id=profile.job_id,
                allocation_id=profile.allocation_id,
                attempt=allocation.attempt,
                steps=profile.steps,
                world_size=profile.world_size,
                state=state,
                requested_by=names.get(profile.requested_by) if profile.requested_by is not None else None,
                created_at=profile.created_at,
                ranks=ranks,
                step_time_s=step_time,
                comm_fraction=comm_fraction,
                slowest_rank=slowest,
            )
        )
    return out


def job_profiles(session: Session, job_id: int) -> list[schemas.ProfileView]:
    rows = list(
        session.scalars(
            select(Profile)
            .where(Profile.job_id == job_id)
            .order_by(Profile.id.desc())
            .options(selectinload(Profile.traces))
        )
    )
    return views(session, rows)
