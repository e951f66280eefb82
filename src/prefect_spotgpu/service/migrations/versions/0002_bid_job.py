"""bids carry the job their allocations run

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bids") as batch:
        batch.add_column(sa.Column("job", sa.JSON(), nullable=True))


def downgrade() -> None:
    # plain DROP COLUMN (SQLite >= 3.35): a batch copy of ``bids`` would drop the table that
    # ``allocations`` references, which SQLite's foreign keys refuse
    op.drop_column("bids", "job")
