"""Admins mint tokens for users and agents; each is shown once."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from phalanx import schemas
from server import auth
from server.api.deps import AdminDep, SessionDep
from server.errors import Conflict
from server.models import User

router = APIRouter(prefix="/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=schemas.TokenCreated)
def create_token(body: schemas.TokenRequest, session: SessionDep, _: AdminDep) -> schemas.TokenCreated:
    with session.begin():
        user_id = None
        if body.kind == "user":
            if session.scalars(select(User).where(User.name == body.name)).first() is not None:
                raise Conflict(f"user {body.name!r} exists already; pick another name")
            user = User(name=body.name, is_admin=False)
            session.add(user)
            session.flush()
            user_id = user.id
        token_id, token = auth.mint(session, body.kind, body.name, user_id)
    return schemas.TokenCreated(id=token_id, kind=body.kind, name=body.name, token=token)
