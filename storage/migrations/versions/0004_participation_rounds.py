"""participations.issued_round, base_round: async runs carry tasks across rounds

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("issued_round", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("base_round", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("participations", schema=None) as batch_op:
        batch_op.drop_column("base_round")
        batch_op.drop_column("issued_round")
