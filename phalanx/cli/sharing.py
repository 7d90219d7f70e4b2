"""Sharing the cluster: `queue`, `usage`, `teams set|hold|release` and `jobs hold|release`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.table import Table

from phalanx.cli.cluster import DURATION_UNITS, print_team, teams_app
from phalanx.cli.jobs import app as jobs_app
from phalanx.cli.output import JsonOpt, api, console, fail, print_json
from phalanx.schemas import JobView, parse_slot_counts


def parse_slots(option: str, text: str | None) -> dict[str, int | None] | None:
    if text is None:
        return None
    try:
        return {kind.value: count for kind, count in parse_slot_counts(text).items()}
    except ValueError as exc:
        fail(f"{option} {text!r}: {exc}", 2)


def parse_moment(option: str, text: str | None) -> datetime | None:
    """An ISO date or time (UTC unless it says otherwise), or a duration ago such as 7d or 12h."""
    if text is None:
        return None
    if text[:-1].isdigit() and text[-1] in DURATION_UNITS:
        return datetime.now(UTC) - timedelta(seconds=int(text[:-1]) * DURATION_UNITS[text[-1]])
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"{option} {text!r}: give an ISO date or time (2026-12-01, 2026-12-01T08:00) or a duration such as 7d", 2)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@teams_app.command("set")
def teams_set(
    team: str,
    weight: Annotated[float | None, typer.Option(help="Fair-share weight, 0.001 to 1000 (default 1).")] = None,
    guarantee: Annotated[
        str | None, typer.Option(help="Slots it can reclaim by preemption, e.g. cpu=8,gpu=2 (gpu=none drops one).")
    ] = None,
    limit: Annotated[str | None, typer.Option(help="The most it may hold, borrowing included, e.g. cpu=32.")] = None,
    user_limit: Annotated[str | None, typer.Option(help="The most one member may hold, e.g. cpu=8.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Set TEAM's share of the cluster (cluster admin); what is left out stays as it is."""
    if weight is None and guarantee is None and limit is None and user_limit is None:
        fail("say what to set: --weight, --guarantee, --limit or --user-limit", 2)
    with api() as client:
        updated = client.set_team_policy(
            team,
            weight=weight,
            guarantee=parse_slots("--guarantee", guarantee),
            limit=parse_slots("--limit", limit),
            user_limit=parse_slots("--user-limit", user_limit),
        )
    if as_json:
        print_json(updated)
    else:
        print_team(updated)


@teams_app.command("hold")
def teams_hold(team: str, as_json: JsonOpt = False) -> None:
    """Hold TEAM's queue: its queued jobs wait (running ones go on) until `teams release`."""
    with api() as client:
        updated = client.hold_team(team)
    print_json(updated) if as_json else console.print(f"team {updated.name}'s queue is held")


@teams_app.command("release")
def teams_release(team: str, as_json: JsonOpt = False) -> None:
    with api() as client:
        updated = client.release_team(team)
    print_json(updated) if as_json else console.print(f"team {updated.name}'s queue is released")


def _held_state(job: JobView, as_json: bool) -> None:
    if as_json:
        print_json({"id": job.id, "state": job.state.value, "held": job.held})
    else:
        console.print(f"job {job.id} {job.state.value}, {'held' if job.held else 'released'}")


@jobs_app.command("hold")
def jobs_hold(job_id: int, as_json: JsonOpt = False) -> None:
    """Keep a job from starting until `jobs release` (an admin of its team, a cluster admin)."""
    with api() as client:
        _held_state(client.hold_job(job_id), as_json)


@jobs_app.command("release")
def jobs_release(job_id: int, as_json: JsonOpt = False) -> None:
    with api() as client:
        _held_state(client.release_job(job_id), as_json)


def queue(
    limit: Annotated[int, typer.Option(help="At most this many jobs.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """The queue in placement order: each job's place, team, size, estimated start and why it waits."""
    with api() as client:
        view = client.queue(limit)
    if as_json:
        print_json(view)
        return
    if not view.entries:
        console.print("the queue is empty")
        return
    table = Table(title=f"{view.queued} queued")
    for column in ("#", "team #", "job", "team", "owner", "prio", "size", "starts ~ (UTC)", "why it waits"):
        table.add_column(column)
    for entry in view.entries:
        table.add_row(
            "held" if entry.held else str(entry.position or "-"),
            str(entry.team_position or "-"),
            f"{entry.job_id} {entry.name}" if entry.job_id is not None else "(another team's)",
            entry.team or "-",
            entry.owner or "-",
            str(entry.priority),
            f"{entry.nodes}x{entry.slots_per_node} {entry.slot_type.value}",
            f"{entry.estimated_start:%m-%d %H:%M}" if entry.estimated_start else "-",
            entry.reason,
        )
    console.print(table)


def usage(
    since: Annotated[str | None, typer.Option(help="Start: an ISO date or time (UTC), or 7d, 12h ago.")] = None,
    until: Annotated[str | None, typer.Option(help="End: an ISO date or time (UTC); default now.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Slot-hours by team, user and slot type (default: the last 7 days): yours and your teams'."""
    with api() as client:
        report = client.usage(parse_moment("--since", since), parse_moment("--until", until))
    if as_json:
        print_json(report)
        return
    table = Table(title=f"slot-hours {report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC")
    for column in ("team", "user", "slot type", "slot-hours", "jobs"):
        table.add_column(column)
    for row in report.rows:
        table.add_row(row.team or "-", row.user, row.slot_type.value, f"{row.slot_hours:.2f}", str(row.jobs))
    console.print(table)
    totals = ", ".join(f"{team or '(no team)'} {hours:.2f}" for team, hours in sorted(report.by_team.items()))
    console.print(f"by team: {totals or 'nothing used'}")
