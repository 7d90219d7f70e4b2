"""runtime environments: the lock a job's (and a study's trials') packages were resolved to

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("env_lock", sa.Text(), nullable=True))
    with op.batch_alter_table("tuning_studies") as batch:
        batch.add_column(sa.Column("env_lock", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tuning_studies") as batch:
        batch.drop_column("env_lock")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("env_lock")
