"""each allocation (attempt) gets its own credential, handed to its ranks instead of the agent's token

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("credential", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("credential")
