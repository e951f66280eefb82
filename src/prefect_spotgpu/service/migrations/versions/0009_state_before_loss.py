"""nodes: the state a node was in when its heartbeats stopped

Revision ID: 0009
Revises: 0008

A silent node is lost whatever its state (live, draining or reclaimed); ``state_before_loss``
keeps what it was, so an agent that comes back returns its node to that state (a reclaimed
node stays reclaimed, a drained one draining) instead of offering it again. NULL while the
node is not lost.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("state_before_loss", sa.String(20)))


def downgrade() -> None:
    op.drop_column("nodes", "state_before_loss")
