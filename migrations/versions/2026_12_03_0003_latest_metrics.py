"""latest metrics per allocation: jobs show/list read them instead of scanning metrics

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 17:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")  # JSONB: it has equality (DISTINCT)
    op.add_column("allocations", sa.Column("latest_metrics", json, nullable=True))
    op.add_column("allocations", sa.Column("latest_step", sa.BigInteger(), nullable=True))
    # Backfill from the metrics already stored: the newest row of each name per allocation.
    metrics = sa.table(
        "metrics",
        sa.column("id", sa.BigInteger()),
        sa.column("allocation_id", sa.Integer()),
        sa.column("name", sa.String()),
        sa.column("value", sa.Float()),
        sa.column("step", sa.BigInteger()),
        sa.column("superseded", sa.Boolean()),
    )
    allocations = sa.table(
        "allocations",
        sa.column("id", sa.Integer()),
        sa.column("latest_metrics", sa.JSON()),
        sa.column("latest_step", sa.BigInteger()),
    )
    newest = (
        sa.select(sa.func.max(metrics.c.id))
        .where(metrics.c.superseded.is_(False))
        .group_by(metrics.c.allocation_id, metrics.c.name)
    )
    rows = op.get_bind().execute(
        sa.select(metrics.c.allocation_id, metrics.c.name, metrics.c.value, metrics.c.step).where(
            metrics.c.id.in_(newest)
        )
    )
    latest: dict[int, tuple[dict[str, float], int]] = {}
    for allocation_id, name, value, step in rows:
        values, newest_step = latest.setdefault(allocation_id, ({}, step))
        values[name] = value
        latest[allocation_id] = (values, max(newest_step, step))
    for allocation_id, (values, step) in latest.items():
        op.get_bind().execute(
            allocations.update()
            .where(allocations.c.id == allocation_id)
            .values(latest_metrics=values, latest_step=step)
        )


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("latest_step")
        batch.drop_column("latest_metrics")
