"""The cluster: its agents (`agents list|drain`) and API tokens (`tokens create`, admin)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from phalanx.cli.output import JsonOpt, api, console, fail, print_json

agents_app = typer.Typer(help="Inspect agents (the nodes that run workers).", no_args_is_help=True)
tokens_app = typer.Typer(help="Mint API tokens (admin).", no_args_is_help=True)


@agents_app.command("drain")
def agents_drain(agent: Annotated[str, typer.Argument(help="Agent name or id.")], as_json: JsonOpt = False) -> None:
    """Place no more work on an agent; the jobs on it checkpoint, stop, and restart elsewhere."""
    with api() as client:
        known = client.agents()
        match = next((a for a in known if a.name == agent or str(a.id) == agent), None)
        if match is None:
            fail(f"no agent named {agent!r}; `phalanx agents list` shows them")
        drained = client.drain_agent(match.id)
    if as_json:
        print_json(drained)
    else:
        console.print(f"agent {drained.name} {drained.state.value}")


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


@tokens_app.command("create")
def tokens_create(
    name: str,
    kind: Annotated[str, typer.Option(help="user or agent")] = "user",
    as_json: JsonOpt = False,
) -> None:
    """Mint a token (shown once)."""
    if kind not in ("user", "agent"):
        fail("--kind must be 'user' or 'agent'", 2)
    with api() as client:
        created = client.create_token(kind, name)
    if as_json:
        print_json(created)
    else:
        console.print(f"{created.kind} token for {created.name} (shown once): {created.token}")
