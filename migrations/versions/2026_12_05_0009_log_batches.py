"""log batches already stored, so an agent retrying after a lost answer stores no line twice

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "log_batches",
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"],
            ["allocations.id"],
            name=op.f("fk_log_batches_allocation_id_allocations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("allocation_id", "batch_id", name=op.f("pk_log_batches")),
    )


def downgrade() -> None:
    op.drop_table("log_batches")
