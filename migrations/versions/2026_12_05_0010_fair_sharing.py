"""fair sharing: team weights, guarantees and limits, holds, and who preempted whom

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("teams") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("guarantee", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("slot_limit", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("user_limit", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("queue_held", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("held", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("preempted_by", sa.Integer(), nullable=True))
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("stop_grace", sa.Float(), nullable=True))
    with op.batch_alter_table("allocation_nodes") as batch:
        batch.create_index(op.f("ix_allocation_nodes_ended_at"), ["ended_at"])


def downgrade() -> None:
    with op.batch_alter_table("allocation_nodes") as batch:
        batch.drop_index(op.f("ix_allocation_nodes_ended_at"))
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("stop_grace")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preempted_by")
        batch.drop_column("held")
    with op.batch_alter_table("teams") as batch:
        for column in ("queue_held", "user_limit", "slot_limit", "guarantee", "weight"):
            batch.drop_column(column)
