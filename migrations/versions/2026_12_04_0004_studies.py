"""hyperparameter studies: tuning_studies and tuning_trials beside Optuna's own tables

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tuning_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("optuna_name", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("bundle_sha256", sa.String(length=64), nullable=True),
        sa.Column("bundle_size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("running_since", sa.DateTime(), nullable=True),
        sa.Column("running_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], name=op.f("fk_tuning_studies_owner_id_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_studies")),
        sa.UniqueConstraint("optuna_name", name=op.f("uq_tuning_studies_optuna_name")),
    )
    op.create_index(op.f("ix_tuning_studies_state"), "tuning_studies", ["state"], unique=False)
    op.create_table(
        "tuning_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("values", sa.JSON(), nullable=True),
        sa.Column("reported_step", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_tuning_trials_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["tuning_studies.id"],
            name=op.f("fk_tuning_trials_study_id_tuning_studies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_trials")),
        sa.UniqueConstraint("job_id", name=op.f("uq_tuning_trials_job_id")),
        sa.UniqueConstraint("optuna_trial_id", name=op.f("uq_tuning_trials_optuna_trial_id")),
        sa.UniqueConstraint("study_id", "number", name=op.f("uq_tuning_trials_study_id_number")),
    )
    op.create_index(op.f("ix_tuning_trials_study_id"), "tuning_trials", ["study_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_tuning_trials_study_id"), table_name="tuning_trials")
    op.drop_table("tuning_trials")
    op.drop_index(op.f("ix_tuning_studies_state"), table_name="tuning_studies")
    op.drop_table("tuning_studies")
