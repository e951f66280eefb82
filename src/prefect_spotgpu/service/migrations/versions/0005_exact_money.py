"""exact money: balances, charges, credits and compensation in whole micros (BigInteger)

Revision ID: 0005
Revises: 0004

Each float money column becomes a BigInteger of micros (1 unit = 1 000 000), rounded to the
nearest micro: ``tenants.credits``/``spent`` -> ``credits_micros``/``spent_micros``,
``allocations.charged_amount`` -> ``charged_micros``, ``allocations.paid_at_checkpoint`` ->
``paid_at_checkpoint_micros``, ``ledger_entries.amount`` -> ``amount_micros``; and
``allocations.charge_carry`` (what a running allocation owes below one micro) is new. A
tenant's ``spent_micros`` is then set to the sum of its allocations' ``charged_micros`` and its
``credits_micros`` to the sum of its ledger entries, so the stored totals agree exactly from
the first tick on (float sums differed in their last digits).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

RENAMED = [  # table, float column, micros column
    ("tenants", "credits", "credits_micros"),
    ("tenants", "spent", "spent_micros"),
    ("allocations", "charged_amount", "charged_micros"),
    ("allocations", "paid_at_checkpoint", "paid_at_checkpoint_micros"),
    ("ledger_entries", "amount", "amount_micros"),
]
TOTALS = """
UPDATE tenants SET
  spent_micros = COALESCE(
    (SELECT SUM(a.charged_micros) FROM allocations a WHERE a.tenant_id = tenants.id), 0),
  credits_micros = COALESCE(
    (SELECT SUM(e.amount_micros) FROM ledger_entries e WHERE e.tenant_id = tenants.id), 0)
"""


def upgrade() -> None:
    # plain ADD/DROP COLUMN (SQLite >= 3.35 has both): a batch copy of ``tenants`` would trip
    # the foreign keys of every table that references it
    for table, old, new in RENAMED:
        op.add_column(table, sa.Column(new, sa.BigInteger(), nullable=False, server_default="0"))
        op.execute(f"UPDATE {table} SET {new} = ROUND({old} * 1000000)")
        op.drop_column(table, old)
    op.add_column(
        "allocations",
        sa.Column("charge_carry", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.execute(TOTALS)


def downgrade() -> None:
    op.drop_column("allocations", "charge_carry")
    for table, old, new in RENAMED:
        op.add_column(table, sa.Column(old, sa.Float(), nullable=False, server_default="0"))
        op.execute(f"UPDATE {table} SET {old} = {new} / 1000000.0")
        op.drop_column(table, new)
