"""The `phalanx` user commands: jobs, studies, checkpoints, agents, tokens, teams, the queue and
usage. Every read command
takes --json; errors say how to fix them.

The commands that run Phalanx itself (`server`, `scheduler`, `agent`, `db upgrade`, `up`, `demo`)
are not here: `stack.cli` adds them to these, so that this package never imports the server.
"""

from __future__ import annotations

import typer

from phalanx.cli import cluster, jobs, sharing, studies

app = typer.Typer(
    help="Phalanx: distributed PyTorch training on your own machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(jobs.submit)
app.add_typer(jobs.app, name="jobs")
app.add_typer(cluster.agents_app, name="agents")
app.add_typer(cluster.tokens_app, name="tokens")
app.add_typer(cluster.teams_app, name="teams")
app.add_typer(jobs.checkpoints_app, name="checkpoints")
app.add_typer(studies.app, name="studies")
app.command()(sharing.queue)
app.command()(sharing.usage)

if __name__ == "__main__":
    app()
