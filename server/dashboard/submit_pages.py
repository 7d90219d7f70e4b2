"""The submit page: upload a job or study file (and its code); mistakes shown beside the field they name."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(include_in_schema=False)
