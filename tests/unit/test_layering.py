"""`phalanx` is what users import: it never imports the server, the scheduler, the agent or the
launchers (`stack`), not even lazily inside a function; `stack` builds the whole command on it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import typer.main

from phalanx.cli import main as user_cli
from stack import cli as full_cli

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {"server", "scheduler", "worker_agent", "stack"}
LAUNCHERS = {"server", "scheduler", "agent", "up", "demo", "db"}


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import statement names, wherever it stands, plus `import_module("...")`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def test_no_phalanx_module_imports_the_server_side() -> None:
    offending = []
    for path in sorted((REPO / "phalanx").rglob("*.py")):
        for module in imported_modules(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in FORBIDDEN:
                offending.append(f"{path.relative_to(REPO)}: {module}")
    assert offending == [], offending


def test_the_checker_sees_lazy_imports() -> None:
    source = (
        "def f():\n"
        "    from server.db import upgrade\n"
        "    import scheduler.tasks\n"
        "    importlib.import_module('stack.cli')\n"
    )
    assert {"server.db", "scheduler.tasks", "stack.cli"} <= imported_modules(ast.parse(source))


def test_importing_the_user_commands_loads_nothing_of_the_server_side() -> None:
    probe = (
        "import sys, phalanx, phalanx.client, phalanx.schemas, phalanx.cli.main; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_full_command_is_the_user_commands_plus_the_launchers() -> None:
    user = set(typer.main.get_command(user_cli.app).commands)
    full = set(typer.main.get_command(full_cli.app).commands)
    assert {"submit", "jobs", "studies", "agents", "checkpoints", "tokens"} <= user
    assert not user & LAUNCHERS
    assert full == user | LAUNCHERS
