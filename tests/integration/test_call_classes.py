"""The balancer's path rule (deploy/Caddyfile) against the app's routes: every call an agent makes
about its nodes and every call of a rank goes to the nodes' pool of servers, everything else (the
people's calls, the dashboard, registration and the agents' heartbeats) to the people's pool.

A route added under an agent or an allocation must be put in one class or the other here: a
node's call sent to the people's pool is served there all the same, but it brings back the
queueing that the split exists to remove."""

from __future__ import annotations

import re
from pathlib import Path

from server.api.admission import SHEDDABLE
from server.settings import Settings
from tests.integration.test_authorization import app_routes

BALANCER_ROUTES = Path(__file__).resolve().parents[2] / "deploy" / "Caddyfile"
NODE_CALLS = {
    ("GET", "/api/v1/agents/{agent_id}/work"),
    ("POST", "/api/v1/agents/{agent_id}/reports"),
    ("POST", "/api/v1/agents/{agent_id}/logs"),
    ("POST", "/api/v1/agents/{agent_id}/allocations/{allocation_id}/rendezvous"),
    ("POST", "/api/v1/agents/{agent_id}/allocations/{allocation_id}/started"),
    ("POST", "/api/v1/agents/{agent_id}/allocations/{allocation_id}/exit"),
    ("POST", "/api/v1/agents/{agent_id}/allocations/{allocation_id}/environment"),
    ("POST", "/api/v1/agents/{agent_id}/allocations/{allocation_id}/logs"),
    ("POST", "/api/v1/allocations/{allocation_id}/metrics"),
    ("POST", "/api/v1/allocations/{allocation_id}/checkpoints"),
    ("PUT", "/api/v1/allocations/{allocation_id}/profiles/{profile_id}/ranks/{rank}"),
}


def balancer_rule() -> re.Pattern[str]:
    """The nodes' pattern as Caddy reads it (RE2; this one means the same to Python's `re`)."""
    found = re.findall(r"@nodes path_regexp (\S+)", BALANCER_ROUTES.read_text())
    assert len(found) == 1, f"deploy/Caddyfile has {len(found)} `@nodes path_regexp` lines, not one"
    return re.compile(found[0])


def concrete(path: str) -> str:
    """A path as a client sends it: every parameter a row id."""
    return re.sub(r"\{[^}]+\}", "7", path)


def test_the_balancer_sends_exactly_the_nodes_calls_to_the_nodes_pool(settings: Settings) -> None:
    routes = app_routes(settings)
    assert routes >= NODE_CALLS, f"node calls that are no longer routes: {sorted(NODE_CALLS - routes)}"
    rule = balancer_rule()
    to_nodes = {(method, path) for method, path in routes if rule.search(concrete(path))}
    assert to_nodes - NODE_CALLS == set(), "the rule sends these people's calls to the nodes' pool"
    assert NODE_CALLS - to_nodes == set(), "the rule leaves these nodes' calls to the people's pool"


def test_every_call_the_door_may_refuse_goes_to_the_nodes_pool(settings: Settings) -> None:
    sheddable = {(m, p) for m, p in app_routes(settings) if SHEDDABLE.fullmatch(concrete(p))}
    assert sheddable, "the door's pattern matches no route"
    assert sheddable <= NODE_CALLS, "the door refuses calls the people's pool serves"


def test_a_heartbeat_and_a_person_s_page_stay_with_the_people() -> None:
    rule = balancer_rule()
    for path in (
        "/api/v1/agents/7/heartbeat",
        "/api/v1/agents/register",
        "/api/v1/agents",
        "/api/v1/jobs/7",
        "/jobs/7",
        "/api/v1/agents/7/workers",  # a lookalike of a node call's path
        "/api/v1/allocationsx/7/metrics",
    ):
        assert not rule.search(path), f"{path} would go to the nodes' pool"
