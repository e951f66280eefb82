"""gangs: a bid on several nodes, and the address other nodes reach a node at

Revision ID: 0007
Revises: 0006

A gang bid (``node_count`` > 1) is stored as ``node_count`` rows of ``bids``, one per member
(rank 0..n-1 in id order), every row with the same terms and ``gang_id``, the id of the first
member (rank 0); a one-node bid keeps ``node_count`` 1 and ``gang_id`` NULL. ``nodes.address``
is the IP or hostname a node's agent advertises: rank 0's is a gang's ``MASTER_ADDR``.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("bids", sa.Column("node_count", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("bids", sa.Column("gang_id", sa.BigInteger()))
    op.create_index("ix_bids_gang_id", "bids", ["gang_id"])
    op.add_column("nodes", sa.Column("address", sa.String(253)))


def downgrade() -> None:
    op.drop_column("nodes", "address")
    op.drop_index("ix_bids_gang_id", "bids")
    op.drop_column("bids", "gang_id")
    op.drop_column("bids", "node_count")
