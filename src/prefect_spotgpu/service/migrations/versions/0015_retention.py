"""retention: price bars' width, archived charges, indexes on the times rows are pruned by

Revision ID: 0015
Revises: 0014

``price_bars.seconds`` is a bar's width: 60 for every bar written so far (a minute, as the tick
writes it), 3600 for an hour that retention folded from its minute bars. ``archived_charges``
keeps, per tenant, the charges of the ended allocations retention removed, so its
``spent_micros`` stays the sum of its allocations' charges and these. The indexes let each
pruning batch read its oldest rows by time, and the oldest bars of a width
(``service/retention.py``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TIME_INDEXES = (
    ("ix_events_created_at", "events", "created_at"),
    ("ix_node_reports_created_at", "node_reports", "created_at"),
    ("ix_webhook_deliveries_updated_at", "webhook_deliveries", "updated_at"),
    ("ix_allocations_ended_at", "allocations", "ended_at"),
)
BAR_INDEX = ("ix_price_bars_seconds_minute", "price_bars", ["seconds", "minute"])


def upgrade() -> None:
    op.add_column(
        "price_bars", sa.Column("seconds", sa.Integer(), nullable=False, server_default="60")
    )
    op.create_table(
        "archived_charges",
        sa.Column(
            "tenant_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("allocations", sa.BigInteger(), nullable=False),
        sa.Column("charged_micros", sa.BigInteger(), nullable=False),
        sa.Column("charged_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    for name, table, column in TIME_INDEXES:
        op.create_index(name, table, [column])
    op.create_index(*BAR_INDEX)


def downgrade() -> None:
    """Back to 0014: hourly bars stay as bars at their hour's first minute; the archived
    charges are dropped (a tenant's spent then exceeds its remaining allocations' charges)."""
    op.drop_index(BAR_INDEX[0], table_name=BAR_INDEX[1])
    for name, table, _ in TIME_INDEXES:
        op.drop_index(name, table_name=table)
    op.drop_table("archived_charges")
    with op.batch_alter_table("price_bars") as batch:
        batch.drop_column("seconds")
