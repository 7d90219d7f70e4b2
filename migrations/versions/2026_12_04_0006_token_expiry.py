"""API tokens may expire, and the tokens taken from the settings are marked so that a rotated
PHALANX_ADMIN_TOKEN / PHALANX_AGENT_TOKEN retires the old value

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# A frozen copy: what the table looked like when this revision was written.
api_tokens = sa.table(
    "api_tokens", sa.column("kind", sa.String), sa.column("name", sa.String), sa.column("configured", sa.Boolean)
)


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("configured", sa.Boolean(), nullable=False, server_default=sa.false()))
    # The settings' tokens were minted as user "admin" and agent "agents" (POST /tokens cannot make
    # another user named "admin").
    op.execute(
        api_tokens.update()
        .where(
            sa.or_(
                sa.and_(api_tokens.c.kind == "user", api_tokens.c.name == "admin"),
                sa.and_(api_tokens.c.kind == "agent", api_tokens.c.name == "agents"),
            )
        )
        .values(configured=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("configured")
        batch.drop_column("expires_at")
