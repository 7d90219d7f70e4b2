"""Agents' heartbeats answered below the framework.

A heartbeat is the most frequent call there is (1,000 agents every 2 s: 500 a second) and the
cheapest: no body, no query of its own (`server/heartbeats.py` writes them in batches). Through
FastAPI it cost ~1.1 ms of the server's one core, most of it the middleware stack, matching the
route among ~150 and solving its dependencies; at 1,000 agents that alone took half the core, and
heartbeats queued behind each other for seconds (`bench/bench_scale.py`).

`HeartbeatFastPath`, the outermost middleware, answers `POST /api/v1/agents/{id}/heartbeat`
itself when all is well: no body, a bearer token the token cache knows, that `access` lets act
for that agent, and a heartbeat that counts. Anything else, every refusal included, goes on to the
app unchanged, whose route does the same (a refused beat is beaten again there, which changes
nothing) and words the answer; so the route stays the one definition of the call, the table in
`tests/integration/test_authorization.py` holds for both, and the answer it gives carries the
same headers.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from server import access
from server.api.deps import MAX_ROW_ID, Services, cached_principal
from server.errors import PhalanxError
from server.security_headers import ALWAYS, CONTENT_SECURITY_POLICY

HEARTBEAT_PATH = re.compile(r"/api/v1/agents/([1-9][0-9]{0,9})/heartbeat")
NO_CONTENT = [*ALWAYS, (b"content-security-policy", CONTENT_SECURITY_POLICY.encode())]


class HeartbeatFastPath:
    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and await self._answered(scope, send):
            return
        await self.app(scope, receive, send)

    async def _answered(self, scope: Scope, send: Send) -> bool:
        match = HEARTBEAT_PATH.fullmatch(scope["path"])
        if match is None or int(match[1]) > MAX_ROW_ID:
            return False
        agent_id = int(match[1])
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
            elif (name == b"content-length" and value != b"0") or name == b"transfer-encoding":
                return False  # a body: the app caps and ignores it
        principal = cached_principal(self.services, token.decode("latin-1")) if token else None
        if principal is None:
            return False
        try:
            access.agent_acts_as(principal, agent_id)
            await self.services.heartbeats.beat(agent_id)
        except PhalanxError:
            return False
        await send({"type": "http.response.start", "status": 204, "headers": NO_CONTENT})
        await send({"type": "http.response.body", "body": b""})
        return True
