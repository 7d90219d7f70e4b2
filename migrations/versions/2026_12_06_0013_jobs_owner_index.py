"""jobs indexed by owner: a user's job lists find their own jobs without reading everyone's

`access.job_readable` is `owner_id = :user OR team_id IN (:teams)`. With only `team_id` indexed,
PostgreSQL answered a list page for a user with few jobs by walking every job newest first
(EXPLAIN at 100,000 jobs: 100,000 rows removed by the filter, 55 ms). With this index, and the
team ids as values (`access.member_teams`), it reads the user's own jobs by this index (or a
BitmapOr with the team index) and sorts those few: under 1 ms.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 18:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f("ix_jobs_owner_id"), "jobs", ["owner_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_owner_id"), table_name="jobs")
