"""bids: the fewest nodes a gang may go on with

Revision ID: 0013
Revises: 0012

``min_node_count`` is NULL for every bid written before (a gang runs whole, as it did) and for
every one-node bid; a gang that may go on smaller when no replacement is free stores it on
every member's row, as it does ``node_count``.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("bids", sa.Column("min_node_count", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("bids", "min_node_count")
