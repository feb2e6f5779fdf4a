"""participations.update_data: a small accepted update's own bytes, until its round ends

An update of at most 64 KiB is written into its participation row by the statement that
accepts it, durable with that write's group commit, instead of as a file of its own with
two fsyncs (fedra.storage.spool). Indexed by update_sha256, by which spooled updates are
read.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("update_data", sa.LargeBinary(), nullable=True))
        batch_op.create_index("ix_participations_update_sha256", ["update_sha256"])


def downgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.drop_index("ix_participations_update_sha256")
        batch_op.drop_column("update_data")
