"""nodes: the runner each node's agent runs jobs with, and a Docker node's default image

Revision ID: 0010
Revises: 0009

The market places a bid only where it can run as asked (``market.types.Runner``): a bid that
names an image only on Docker nodes, a bid without one on process nodes or on Docker nodes with
a default image. ``runner`` is NULL for a node whose agent has not said (an older agent): it
serves any bid, as before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("runner", sa.String(16)))
    op.add_column("nodes", sa.Column("default_image", sa.String(300)))


def downgrade() -> None:
    op.drop_column("nodes", "default_image")
    op.drop_column("nodes", "runner")
