"""on-demand profiles (a request per attempt, each rank's trace and its summary) and scaling runs

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("profile_request", sa.Integer(), nullable=True))
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("requested_by", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["allocation_id"],
            ["allocations.id"],
            name=op.f("fk_profiles_allocation_id_allocations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_profiles_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["requested_by"], ["users.id"], name=op.f("fk_profiles_requested_by_users"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profiles")),
    )
    op.create_index(op.f("ix_profiles_job_id"), "profiles", ["job_id"], unique=False)
    op.create_table(
        "profile_traces",
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["profile_id"],
            ["profiles.id"],
            name=op.f("fk_profile_traces_profile_id_profiles"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("profile_id", "rank", name=op.f("pk_profile_traces")),
    )

    op.create_table(
        "scaling_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("team_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("bundle_sha256", sa.String(length=64), nullable=True),
        sa.Column("bundle_size", sa.BigInteger(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("warmup", sa.Integer(), nullable=False),
        sa.Column("job_ids", sa.JSON(), nullable=False),
        sa.Column("measured", sa.JSON(), nullable=False),
        sa.Column("size_started_at", sa.DateTime(), nullable=True),
        sa.Column("reached_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], name=op.f("fk_scaling_runs_owner_id_users")),
        sa.ForeignKeyConstraint(["team_id"], ["teams.id"], name=op.f("fk_scaling_runs_team_id_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scaling_runs")),
    )
    op.create_index(op.f("ix_scaling_runs_state"), "scaling_runs", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_scaling_runs_state"), table_name="scaling_runs")
    op.drop_table("scaling_runs")
    op.drop_table("profile_traces")
    op.drop_index(op.f("ix_profiles_job_id"), table_name="profiles")
    op.drop_table("profiles")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("profile_request")
