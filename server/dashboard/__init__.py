"""The web dashboard's routes: server-rendered pages (templates in web/templates), signed in with a
user token kept in an http-only, same-site cookie; every form carries a CSRF token.

`render.py` holds what every page shares (rendering; the no-session, forged-form and not-found
refusals, mapped to pages in one place); one module per area holds its pages."""

from __future__ import annotations

from fastapi import APIRouter

from server.dashboard import (
    cluster_pages,
    job_pages,
    live,
    scaling_pages,
    sharing_pages,
    sign_in,
    study_pages,
    submit_pages,
    team_pages,
)

ROUTERS: tuple[APIRouter, ...] = (
    sign_in.router,
    cluster_pages.router,
    job_pages.router,
    scaling_pages.router,
    study_pages.router,
    submit_pages.router,
    team_pages.router,
    sharing_pages.router,
    live.router,
)
