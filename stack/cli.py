"""The whole `phalanx` command: the user commands (`phalanx.cli.main`) and the commands that
run Phalanx's processes (`stack.commands`). The console script and `python -m stack` run it."""

from __future__ import annotations

import typer

from phalanx.cli.main import app as user_app
from stack import commands

app = typer.Typer(help=user_app.info.help, no_args_is_help=True, pretty_exceptions_enable=False)
for launcher in (commands.server, commands.scheduler, commands.agent, commands.up, commands.demo):
    app.command()(launcher)
app.add_typer(user_app)  # without a name: its commands and groups join these at the top level
app.add_typer(commands.db_app, name="db")


def main() -> None:
    app(prog_name="phalanx")
