"""rounds of failed or cancelled runs: an open one ends in its run's state

A run that ends failed or cancelled now ends its open round in the same transaction
(Store.set_run_state); rounds left open by runs that ended before that are ended here,
at the time their run last changed.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for state in ("failed", "cancelled"):
        op.execute(
            "UPDATE rounds SET state = '" + state + "', closed_at = "
            "(SELECT runs.updated_at FROM runs WHERE runs.id = rounds.run_id) "
            "WHERE state = 'open' AND run_id IN "
            "(SELECT id FROM runs WHERE state = '" + state + "')"
        )


def downgrade() -> None:
    # An ended round of an ended run reads as open again to an older fedra, as it did.
    op.execute(
        "UPDATE rounds SET state = 'open', closed_at = NULL WHERE state IN ('failed', 'cancelled')"
    )
