"""retention: a mark per task (how far it has gone) and the time indexes it reads by

BRIN on PostgreSQL (rows arrive in time order; a few kilobytes cover 100 M points and inserts
barely pay for it), a B-tree on SQLite, which has no BRIN.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "retention_marks",
        sa.Column("what", sa.String(length=32), nullable=False),
        sa.Column("until", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("what", name=op.f("pk_retention_marks")),
    )
    for table in ("metrics", "log_lines"):
        op.create_index(
            f"ix_{table}_time", table, ["time"], postgresql_using="brin", postgresql_with={"autosummarize": "on"}
        )


def downgrade() -> None:
    op.drop_index("ix_log_lines_time", table_name="log_lines")
    op.drop_index("ix_metrics_time", table_name="metrics")
    op.drop_table("retention_marks")
