"""What every user command prints with: the consoles, errors a person can act on, JSON, formats."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import httpx
import typer
from pydantic import BaseModel
from rich.console import Console

from phalanx.client import ApiError, Client

console = Console()
err = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


@contextmanager
def api() -> Iterator[Client]:
    """A client for PHALANX_URL/PHALANX_TOKEN; the server's refusals and an unreachable server
    end the command with a message, not a traceback."""
    client = Client()
    try:
        yield client
    except ApiError as exc:
        fail(exc.message)
    except httpx.TransportError as exc:
        fail(
            f"cannot reach Phalanx at {client.url} ({exc.__class__.__name__}). "
            "Start it with `phalanx up`, or point PHALANX_URL at a running server."
        )
    finally:
        client.close()


def jsonable(model: BaseModel) -> Any:
    """The model as the server writes it: NaN and infinities as "NaN", "Infinity", "-Infinity"
    (`model_dump(mode="json")` keeps them floats, which json.dumps would write as invalid JSON)."""
    return json.loads(model.model_dump_json())


def print_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = jsonable(value)
    elif isinstance(value, list):
        value = [jsonable(v) if isinstance(v, BaseModel) else v for v in value]
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def fmt_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def fmt_value(values: list[float] | None) -> str:
    return "-" if not values else ", ".join(f"{v:.5g}" for v in values)


def fmt_params(params: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
