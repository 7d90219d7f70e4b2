"""What submitting a job or a study uploads: the spec (JSON) and the workdir's code bundle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from server.errors import Unprocessable

M = TypeVar("M", bound=BaseModel)


class InvalidSpec(Unprocessable):
    """A spec that does not validate: `detail` holds one problem per field, `errors` pydantic's own
    (each field's path as a tuple), for a caller that points at the field in the user's file."""

    def __init__(self, what: str, exc: ValidationError) -> None:
        self.errors = exc.errors(include_input=False, include_url=False)[:MAX_PROBLEMS]
        problems = [{"field": _field(e["loc"]), "problem": e["msg"]} for e in self.errors]
        summary = "; ".join(f"{p['field'] or 'spec'}: {p['problem']}" for p in problems)
        super().__init__(f"invalid {what}: {summary}", problems)


MAX_PROBLEMS = 20
MAX_NAME_IN_FIELD = 64  # a key is part of a field's path: a hostile one is not echoed in full


def _field(loc: tuple[int | str, ...]) -> str:
    parts = (str(part) for part in loc)
    return ".".join(part if len(part) <= MAX_NAME_IN_FIELD else part[:MAX_NAME_IN_FIELD] + "…" for part in parts)


def invalid_batch(what: str, exc: ValidationError) -> Unprocessable:
    """422 naming the first problems of a batch, where they are (`records.3.values.loss`) and
    without echoing the values (a NaN cannot even be written back as JSON)."""
    errors = exc.errors(include_input=False, include_context=False, include_url=False)[:10]
    problems = [{"field": _field(e["loc"]), "problem": e["msg"]} for e in errors]
    summary = "; ".join(f"{p['field']}: {p['problem']}" for p in problems[:3])
    return Unprocessable(f"invalid {what}: {summary}", problems)


def parse_spec(model: type[M], raw: str | Mapping[str, Any], what: str) -> M:
    """Validate a spec (JSON text, or a spec file's parsed YAML), or 422 with one problem per field
    (`detail`) and a summary naming them."""
    try:
        return model.model_validate_json(raw) if isinstance(raw, str) else model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidSpec(what, exc) from exc
