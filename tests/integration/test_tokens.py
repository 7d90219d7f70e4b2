"""API tokens: minted by admins, listed and revoked by their owners, expiring by the database
clock, and a rotated PHALANX_ADMIN_TOKEN retiring the old value."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import text, update

from server import auth
from server.app import create_app
from server.db import session_scope
from server.models import ApiToken
from server.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.integration.test_api import USER


def mint(client: TestClient, name: str, **extra: object) -> dict[str, object]:
    created = client.post("/api/v1/tokens", json={"kind": "user", "name": name, **extra}, headers=USER)
    assert created.status_code == 201, created.text
    body: dict[str, object] = created.json()
    return body


def bearer(created: dict[str, object]) -> dict[str, str]:
    return {"Authorization": f"Bearer {created['token']}"}


def test_owners_list_and_revoke_their_own(client: TestClient) -> None:
    alice, bob = mint(client, "alice"), mint(client, "bob")
    assert [t["name"] for t in client.get("/api/v1/tokens", headers=bearer(alice)).json()] == ["alice"]
    listed = client.get("/api/v1/tokens", headers=USER).json()  # the admin sees every token
    assert {"admin", "agents", "alice", "bob"} <= {t["name"] for t in listed}
    assert all("token" not in t for t in listed)  # never the value again
    assert client.delete(f"/api/v1/tokens/{bob['id']}", headers=bearer(alice)).status_code == 404
    assert client.get("/api/v1/jobs", headers=bearer(bob)).status_code == 200  # untouched
    assert client.delete(f"/api/v1/tokens/{alice['id']}", headers=bearer(alice)).status_code == 204
    assert client.get("/api/v1/jobs", headers=bearer(alice)).status_code == 401  # at once
    assert client.post("/api/v1/tokens", json={"name": "x"}, headers=bearer(bob)).status_code == 403


def test_a_token_expires_by_the_database_clock(client: TestClient, settings: Settings) -> None:
    created = mint(client, "carol", expires_in_s=3600)
    assert created["expires_at"] is not None
    assert client.get("/api/v1/jobs", headers=bearer(created)).status_code == 200
    with session_scope(settings.database_url) as session:
        session.execute(
            update(ApiToken)
            .where(ApiToken.id == created["id"])
            .values(expires_at=text("timezone('utc', now()) - interval '1 second'"))
        )
    client.app.state.services.token_cache.forget(created["id"])  # type: ignore[attr-defined]
    assert client.get("/api/v1/jobs", headers=bearer(created)).status_code == 401
    too_short = client.post("/api/v1/tokens", json={"name": "dave", "expires_in_s": 1}, headers=USER)
    assert too_short.status_code == 422


def test_a_rotated_admin_token_retires_the_old_value(client: TestClient, settings: Settings) -> None:
    rotated = settings.model_copy(update={"admin_token": "phx_u_rotated-admin-token"})
    with TestClient(create_app(rotated, enqueue=lambda *_, **__: None)) as again:
        assert again.get("/api/v1/jobs", headers=USER).status_code == 401
        assert (
            again.get("/api/v1/jobs", headers={"Authorization": "Bearer phx_u_rotated-admin-token"}).status_code == 200
        )
    with session_scope(settings.database_url) as session:  # starting again with the same value changes nothing
        assert auth.bootstrap(session, "phx_u_rotated-admin-token", None) is None
        assert auth.lookup(session, ADMIN_TOKEN) is None
