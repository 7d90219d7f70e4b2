"""metrics indexed by (job, name, rank, step): one rank's series is one index range

The dashboard's charts and the study driver read one metric of one rank in step order; with
(job, name, step) a two-rank job's scan read and dropped the other rank's rows (half its time).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 15:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_metrics_job_name_rank_step", "metrics", ["job_id", "name", "rank", "step"])
    op.drop_index("ix_metrics_job_name_step", table_name="metrics")


def downgrade() -> None:
    op.create_index("ix_metrics_job_name_step", "metrics", ["job_id", "name", "step"])
    op.drop_index("ix_metrics_job_name_rank_step", table_name="metrics")
