"""nodes and bids are spot or on-demand capacity; pool quotes are kept per capacity

Revision ID: 0003
Revises: 0002

``pool_quotes`` is a cache the tick leader rewrites every tick, so it is recreated with the
new primary key rather than altered.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _pool_quotes(*key: str) -> None:
    op.create_table(
        "pool_quotes",
        sa.Column("gpu_model", sa.String(length=50), nullable=False),
        sa.Column("region", sa.String(length=63), nullable=False),
        *(
            [sa.Column("capacity", sa.String(length=20), nullable=False)]
            if "capacity" in key
            else []
        ),
        sa.Column("clearing_price", sa.Float(), nullable=True),
        sa.Column("reserve_price", sa.Float(), nullable=True),
        sa.Column("gpus_total", sa.Integer(), nullable=False),
        sa.Column("gpus_free", sa.Integer(), nullable=False),
        sa.Column("gpus_running", sa.Integer(), nullable=False),
        sa.Column("waiting_bids", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint(*key),
    )


def upgrade() -> None:
    for table in ("nodes", "bids"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("capacity", sa.String(length=20), nullable=False, server_default="spot")
            )
    op.drop_table("pool_quotes")
    _pool_quotes("gpu_model", "region", "capacity")


def downgrade() -> None:
    op.drop_table("pool_quotes")
    _pool_quotes("gpu_model", "region")
    op.execute("DELETE FROM bids WHERE capacity = 'on_demand' AND status = 'open'")
    # plain DROP COLUMN (SQLite >= 3.35): a batch copy of ``bids`` or ``nodes`` would drop the
    # table that ``allocations`` references, which SQLite's foreign keys refuse
    for table in ("bids", "nodes"):
        op.drop_column(table, "capacity")
