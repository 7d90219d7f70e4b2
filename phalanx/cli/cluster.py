"""The cluster: its agents (`agents list|drain|undrain`), API tokens (`tokens create|list|revoke`) and
teams (`teams create|list|show|add-member|remove-member`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from phalanx.cli.output import JsonOpt, api, console, fail, print_json
from phalanx.client import Client
from phalanx.schemas import AgentView, TeamView

agents_app = typer.Typer(help="Inspect agents (the nodes that run workers).", no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens: mint (admin), list and revoke.", no_args_is_help=True)
teams_app = typer.Typer(
    help="Teams: their members read each other's jobs; team admins act on them.", no_args_is_help=True
)


def _find_agent(client: Client, agent: str) -> AgentView:
    match = next((a for a in client.agents() if a.name == agent or str(a.id) == agent), None)
    if match is None:
        fail(f"no agent named {agent!r}; `phalanx agents list` shows them")
    return match


@agents_app.command("drain")
def agents_drain(agent: Annotated[str, typer.Argument(help="Agent name or id.")], as_json: JsonOpt = False) -> None:
    """Place no more work on an agent; the jobs on it checkpoint, stop, and restart elsewhere."""
    with api() as client:
        drained = client.drain_agent(_find_agent(client, agent).id)
    if as_json:
        print_json(drained)
    else:
        console.print(f"agent {drained.name} {drained.state.value}")


@agents_app.command("undrain")
def agents_undrain(agent: Annotated[str, typer.Argument(help="Agent name or id.")], as_json: JsonOpt = False) -> None:
    """Place work on a drained agent again (cluster admins)."""
    with api() as client:
        undrained = client.undrain_agent(_find_agent(client, agent).id)
    if as_json:
        print_json(undrained)
    else:
        console.print(f"agent {undrained.name} {undrained.state.value}")


@agents_app.command("list")
def agents_list(as_json: JsonOpt = False) -> None:
    """Registered agents, their slots and heartbeats."""
    with api() as client:
        agents = client.agents()
    if as_json:
        print_json(agents)
        return
    table = Table()
    for column in ("id", "name", "address", "state", "cpu used/total", "gpu used/total", "last heartbeat"):
        table.add_column(column)
    for a in agents:
        table.add_row(
            str(a.id),
            a.name,
            a.address,
            a.state.value,
            f"{a.used_cpu_slots}/{a.cpu_slots}",
            f"{a.used_gpu_slots}/{a.gpu_slots}",
            str(a.last_heartbeat),
        )
    console.print(table)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """ "90m", "12h", "30d", "3600s" (or plain seconds) as seconds."""
    number, unit = (text[:-1], text[-1]) if text and text[-1] in DURATION_UNITS else (text, "s")
    if not number.isdigit():
        fail(f"--expires {text!r}: give a number with s, m, h or d, such as 30d or 12h", 2)
    return int(number) * DURATION_UNITS[unit]


@tokens_app.command("create")
def tokens_create(
    name: str,
    kind: Annotated[str, typer.Option(help="user or agent")] = "user",
    expires: Annotated[str | None, typer.Option(help="Lifetime, such as 12h or 30d (default: until revoked).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Mint a token (admin; shown once)."""
    if kind not in ("user", "agent"):
        fail("--kind must be 'user' or 'agent'", 2)
    lifetime = parse_duration(expires) if expires is not None else None
    with api() as client:
        created = client.create_token(kind, name, lifetime)
    if as_json:
        print_json(created)
        return
    until = f", valid until {created.expires_at:%Y-%m-%d %H:%M} UTC" if created.expires_at else ""
    console.print(f"{created.kind} token for {created.name} (shown once{until}): {created.token}")


@tokens_app.command("list")
def tokens_list(as_json: JsonOpt = False) -> None:
    """Your tokens (an admin sees every token); values are never shown again."""
    with api() as client:
        tokens = client.tokens()
    if as_json:
        print_json(tokens)
        return
    table = Table()
    for column in ("id", "kind", "name", "created", "expires"):
        table.add_column(column)
    for t in tokens:
        expires = f"{t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "never"
        name = f"{t.name} (from the settings)" if t.configured else t.name
        table.add_row(str(t.id), t.kind, name, f"{t.created_at:%Y-%m-%d %H:%M}", expires)
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: int) -> None:
    """The token stops working (within seconds on every server)."""
    with api() as client:
        client.revoke_token(token_id)
    console.print(f"token {token_id} revoked")


def print_team(team: TeamView) -> None:
    members = ", ".join(f"{m.user} ({m.role})" for m in team.members) or "no members yet"
    console.print(f"[bold]{team.name}[/bold]: {members}")
    slots = {
        name: ",".join(f"{kind}={count}" for kind, count in sorted(values.items())) or "none"
        for name, values in (
            ("guarantee", team.guarantee),
            ("limit", team.limit),
            ("per user", team.user_limit),
            ("holding", team.holding),
        )
    }
    held = "  [yellow]queue held[/]" if team.queue_held else ""
    share = "  ".join(f"{name} {value}" for name, value in slots.items())
    console.print(f"weight {team.weight:g}  {share}  queued {team.queued}{held}")


@teams_app.command("create")
def teams_create(name: str, as_json: JsonOpt = False) -> None:
    """Create a team (cluster admin); then `phalanx teams add-member NAME USER --role admin`."""
    with api() as client:
        team = client.create_team(name)
    if as_json:
        print_json(team)
    else:
        console.print(f"team {team.name} created; add members with `phalanx teams add-member {team.name} USER`")


@teams_app.command("list")
def teams_list(as_json: JsonOpt = False) -> None:
    """Your teams and their members (a cluster admin sees every team)."""
    with api() as client:
        teams = client.teams()
    if as_json:
        print_json(teams)
        return
    table = Table()
    for column in ("name", "your role", "members"):
        table.add_column(column)
    for t in teams:
        members = ", ".join(f"{m.user}{' (admin)' if m.role == 'admin' else ''}" for m in t.members)
        table.add_row(t.name, t.your_role or "-", members or "none")
    console.print(table)


@teams_app.command("show")
def teams_show(name: str, as_json: JsonOpt = False) -> None:
    """One team and its members."""
    with api() as client:
        team = client.team(name)
    if as_json:
        print_json(team)
    else:
        print_team(team)


@teams_app.command("add-member")
def teams_add_member(
    team: str,
    user: str,
    role: Annotated[str, typer.Option(help="member or admin (admins manage members and act on the team's jobs)")] = (
        "member"
    ),
    as_json: JsonOpt = False,
) -> None:
    """Add USER to TEAM, or change their role (the team's admins, cluster admins)."""
    if role not in ("member", "admin"):
        fail("--role must be 'member' or 'admin'", 2)
    with api() as client:
        updated = client.set_team_member(team, user, role)
    if as_json:
        print_json(updated)
    else:
        print_team(updated)


@teams_app.command("remove-member")
def teams_remove_member(team: str, user: str, as_json: JsonOpt = False) -> None:
    """Take USER out of TEAM; their jobs in it stay there."""
    with api() as client:
        updated = client.remove_team_member(team, user)
    if as_json:
        print_json(updated)
    else:
        print_team(updated)
