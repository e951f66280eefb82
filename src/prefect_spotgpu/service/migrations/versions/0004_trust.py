"""roles, sealed job secrets, revocable keys, honest compensation, a report audit

Revision ID: 0004
Revises: 0003

- ``tenants.provider``: only a tenant the operator made a provider may register nodes. Tenants
  that already own nodes become providers, so an upgrade keeps existing fleets running.
- ``bids.job_env_sealed``: the job's environment, encrypted by the service (the service seals
  any plaintext ``job.env`` it still finds when it starts: migrations have no key).
- ``api_keys.revoked_at``: a revoked key is refused at once.
- ``allocations.paid_at_checkpoint``: what the allocation had paid at its last durable
  checkpoint, so compensation is what was actually paid since then.
- ``node_reports``: every report a node made, accepted or not.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # plain ADD/DROP COLUMN (SQLite >= 3.35 has both): a batch copy of ``tenants`` would
    # trip the foreign keys of every table that references it
    op.add_column(
        "tenants", sa.Column("provider", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.execute("UPDATE tenants SET provider = (id IN (SELECT DISTINCT owner_id FROM nodes))")
    op.add_column("bids", sa.Column("job_env_sealed", sa.Text(), nullable=True))
    op.add_column("api_keys", sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "allocations",
        sa.Column("paid_at_checkpoint", sa.Float(), nullable=False, server_default="0"),
    )
    # allocations that already reported a checkpoint: what they paid so far is not at risk
    op.execute(
        "UPDATE allocations SET paid_at_checkpoint = charged_amount "
        "WHERE last_checkpoint_at IS NOT NULL"
    )
    op.create_table(
        "node_reports",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("node_id", BIG_ID, nullable=False),
        sa.Column("allocation_id", BIG_ID, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column("cause", sa.String(length=20), nullable=True),
        sa.Column("checkpoint_at", sa.Float(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_node_reports_node_id", "node_reports", ["node_id"])
    op.create_index("ix_node_reports_allocation_id", "node_reports", ["allocation_id"])


def downgrade() -> None:
    op.drop_index("ix_node_reports_allocation_id", table_name="node_reports")
    op.drop_index("ix_node_reports_node_id", table_name="node_reports")
    op.drop_table("node_reports")
    op.drop_column("allocations", "paid_at_checkpoint")
    op.drop_column("api_keys", "revoked_at")
    op.drop_column("bids", "job_env_sealed")
    op.drop_column("tenants", "provider")
