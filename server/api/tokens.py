"""API tokens: admins mint them for users and agents (each shown once); everyone lists and revokes
their own, admins all."""

from __future__ import annotations

from fastapi import APIRouter, Response

from phalanx import schemas
from server import access, commands, views
from server.api.deps import AdminDep, RowId, ServicesDep, SessionDep, UserDep
from server.models import ApiToken

router = APIRouter(prefix="/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=schemas.TokenCreated)
def create_token(body: schemas.TokenRequest, session: SessionDep, _: AdminDep) -> schemas.TokenCreated:
    """A user token makes a new user of that name; `expires_in_s` bounds its life."""
    return commands.create_token(session, body)


@router.get("", response_model=list[schemas.TokenView])
def list_tokens(session: SessionDep, user: UserDep) -> list[schemas.TokenView]:
    """Your tokens; an admin's list has every token. Values are never shown again."""
    with session.begin():
        return [views.token(row) for row in session.scalars(access.visible_tokens(user).order_by(ApiToken.id))]


@router.delete("/{token_id}", status_code=204)
def revoke_token(token_id: RowId, session: SessionDep, services: ServicesDep, user: UserDep) -> Response:
    """The token stops working (in this server at once, in others within seconds)."""
    commands.revoke_token(session, user, token_id)
    services.token_cache.forget(token_id)
    return Response(status_code=204)
