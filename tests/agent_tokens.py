"""The agents' own tokens, as their registrations answered them, for tests that speak the agent
protocol themselves (an agent token acts for its own agent only)."""

from __future__ import annotations

from typing import Any

from tests.conftest import AGENT_TOKEN

CLUSTER_AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}  # registers agents, and nothing else
_tokens: dict[int, str] = {}
_rank_tokens: dict[int, str] = {}  # allocation id -> its token, as last seen in an assignment


def register_agent(client: Any, name: str, cpu_slots: int = 1, **fields: Any) -> int:
    """Register an agent with the cluster's agent token; its own token is kept for `as_agent`."""
    body = {"name": name, "address": "127.0.0.1", "cpu_slots": cpu_slots, **fields}
    answer = client.post("/api/v1/agents/register", json=body, headers=CLUSTER_AGENT)
    assert answer.status_code == 200, answer.text
    _tokens[answer.json()["id"]] = answer.json()["agent_token"]
    return int(answer.json()["id"])


def as_agent(agent_id: int) -> dict[str, str]:
    """The headers of agent `agent_id`'s own token (it must have been registered by this process)."""
    return {"Authorization": f"Bearer {_tokens[agent_id]}"}


def as_rank(client: Any, allocation_id: int) -> dict[str, str]:
    """The headers of the allocation's own token, as its agent hands it to the ranks (found in the
    assignments of the agents registered by this process; once its nodes exited, the one last seen)."""
    for agent_id in list(_tokens):
        work = client.get(f"/api/v1/agents/{agent_id}/work", headers=as_agent(agent_id))
        if work.status_code != 200:
            continue
        for assignment in work.json()["assignments"]:
            if assignment["allocation_id"] == allocation_id:
                _rank_tokens[allocation_id] = assignment["credential"]
                return {"Authorization": f"Bearer {assignment['credential']}"}
    if allocation_id in _rank_tokens:
        return {"Authorization": f"Bearer {_rank_tokens[allocation_id]}"}
    raise AssertionError(f"no registered agent hosts allocation {allocation_id}")


def token_of(headers: dict[str, str]) -> str:
    """The bare token of `as_agent(...)` or `as_rank(...)`, for the SDK's clients."""
    return headers["Authorization"].removeprefix("Bearer ")
