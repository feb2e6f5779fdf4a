"""participations.bytes_cut: bytes of a task's transfers that were cut off or refused

A download cut off midway, an upload cut off or refused (a retry sends the whole update
again), an update refused after it arrived (too late): bytes that crossed the wire for
nothing, counted apart from the task's completed download and accepted upload.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("bytes_cut", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.drop_column("bytes_cut")
