"""The deployment's balancer in front of the server's two pools: deploy/Caddyfile run by real
Caddy, as docker-compose runs it. A job trains through it, and each pool served its own class of
calls alone: the agents' and ranks' calls about nodes on one, the heartbeats and the people's
calls on the other (each server's access log says what it served)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.client import Client, load_job_file
from phalanx.schemas import JobState
from tests.e2e.test_fault_tolerance import SCRIPTED, assert_each_step_once
from tests.integration.test_call_classes import BALANCER_ROUTES, balancer_rule
from tests.processes import Stack, free_port, two_agent_stack, wait_for

pytestmark = pytest.mark.e2e
CADDY = shutil.which("caddy") or "/usr/bin/caddy"
POOLS = ("server-people", "server-nodes")
# uvicorn's access log: `INFO:     127.0.0.1:40000 - "POST /api/v1/agents/1/heartbeat HTTP/1.1" 204`
ACCESS = re.compile(r'"([A-Z]+) (/\S*) HTTP/1\.1" ([0-9]{3})')


def start_pools_behind_caddy(stack: Stack) -> None:
    """Both pools, one server each, behind Caddy on the stack's URL."""
    if not Path(CADDY).exists():
        pytest.fail(f"no Caddy at {CADDY}: apt-get install caddy (.ci/run does)")
    ports = {name: free_port() for name in POOLS}
    for name, port in ports.items():
        stack.start_server(name=name, port=port)
    balancer_env = {
        **stack.env,
        "BALANCER_PORT": str(stack.port),
        "BALANCER_BIND": "127.0.0.1",
        "PEOPLE_SERVERS": f"127.0.0.1:{ports['server-people']}",
        "NODE_SERVERS": f"127.0.0.1:{ports['server-nodes']}",
        "XDG_CONFIG_HOME": str(stack.tmp / "caddy"),
        "XDG_DATA_HOME": str(stack.tmp / "caddy"),
    }
    caddy = [CADDY, "run", "--config", str(BALANCER_ROUTES), "--adapter", "caddyfile"]
    balancer = stack.supervisor.spawn("balancer", caddy, env=balancer_env)
    with Client(stack.url, "") as through_balancer:

        def answered() -> bool:
            if balancer.poll() is not None:
                raise AssertionError(f"Caddy exited with {balancer.returncode}:\n{stack.log('balancer')[-3000:]}")
            return through_balancer.healthy()

        wait_for(answered, 30, "Caddy to pass /healthz on")


@pytest.fixture
def split(clean_db: str, clean_redis: str, tmp_path: Path) -> Iterator[Stack]:
    """The pools behind Caddy; a scheduler and two agents that reach the servers only through it."""
    with two_agent_stack(tmp_path, clean_db, clean_redis, start_servers=start_pools_behind_caddy) as stack:
        yield stack


def served(stack: Stack, pool: str) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request `pool`'s server answered, its /healthz aside (the
    test's own probe called it directly); the path without its query, as the balancer matches it."""
    calls = [(m, p.split("?")[0], int(s)) for m, p, s in ACCESS.findall(stack.log(pool))]
    return [(m, p, s) for m, p, s in calls if p != "/healthz"]


def test_each_pool_serves_its_own_class_of_calls(split: Stack) -> None:
    steps = 40
    spec, workdir = load_job_file(SCRIPTED)
    spec = spec.model_copy(update={"hyperparameters": {"steps": steps, "step_seconds": 0.05}})
    with split.client() as client:
        job = client.submit(spec, workdir)
        final = client.wait(job.id, timeout=180)
        assert final.state is JobState.COMPLETED, final.failure_reason
        assert_each_step_once(client.metrics(job.id, name="step_value"), steps)

    rule = balancer_rule()
    nodes, people = served(split, "server-nodes"), served(split, "server-people")
    strays = [call for call in nodes if not rule.search(call[1])]
    assert not strays, f"the nodes' pool served calls that are not the nodes': {strays[:10]}"
    strays = [call for call in people if rule.search(call[1])]
    assert not strays, f"the people's pool served the nodes' calls: {strays[:10]}"
    node_kinds = {re.sub(r"/[0-9]+", "/N", path) for _, path, _ in nodes}
    for kind in (
        "/api/v1/agents/N/work",
        "/api/v1/agents/N/reports",
        "/api/v1/allocations/N/metrics",
    ):
        assert kind in node_kinds, f"the nodes' pool never served {kind}: {sorted(node_kinds)}"
    people_kinds = {(method, re.sub(r"/[0-9]+", "/N", path)) for method, path, _ in people}
    for call in (("POST", "/api/v1/agents/N/heartbeat"), ("POST", "/api/v1/jobs"), ("POST", "/api/v1/agents/register")):
        assert call in people_kinds, f"the people's pool never served {call}: {sorted(people_kinds)}"
    assert not [call for call in nodes + people if call[2] >= 500], "a pool answered a server error"
