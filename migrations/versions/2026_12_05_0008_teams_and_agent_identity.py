"""teams and their members; jobs and studies belong to a team; each agent holds its own credential

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teams")),
        sa.UniqueConstraint("name", name=op.f("uq_teams_name")),
    )
    op.create_table(
        "team_members",
        sa.Column("team_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(8), nullable=False),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_team_members_team_id_teams"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_team_members_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("team_id", "user_id", name=op.f("pk_team_members")),
    )
    op.create_index(op.f("ix_team_members_user_id"), "team_members", ["user_id"])
    for table in ("jobs", "tuning_studies"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("team_id", sa.Integer(), nullable=True))
            batch.create_foreign_key(op.f(f"fk_{table}_team_id_teams"), "teams", ["team_id"], ["id"])
            batch.create_index(op.f(f"ix_{table}_team_id"), ["team_id"])
    with op.batch_alter_table("agents") as batch:
        batch.add_column(sa.Column("credential_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agents") as batch:
        batch.drop_column("credential_hash")
    for table in ("tuning_studies", "jobs"):
        with op.batch_alter_table(table) as batch:
            batch.drop_index(op.f(f"ix_{table}_team_id"))
            batch.drop_constraint(op.f(f"fk_{table}_team_id_teams"), type_="foreignkey")
            batch.drop_column("team_id")
    op.drop_index(op.f("ix_team_members_user_id"), table_name="team_members")
    op.drop_table("team_members")
    op.drop_table("teams")
