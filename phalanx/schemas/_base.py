"""What every schema module shares: strict request bodies and the name rule."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class StrictModel(BaseModel):
    """A body a person or a program writes: unknown fields are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")
