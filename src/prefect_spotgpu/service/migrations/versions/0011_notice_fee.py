"""allocations: the notice fee a takeover owes for the notices it caused

Revision ID: 0011
Revises: 0010

A bid that outbids running allocations reserves their GPUs and notices them; it pays for those
notices at least (``market/notice_fee.py``): ``notice_fee_micros`` is that floor, set when the
takeover is reserved, 0 for every other allocation. What its charges have not covered by its
end is charged then. A leader rebuilding the market reads it back (less ``charged_micros``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "allocations",
        sa.Column("notice_fee_micros", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("allocations", "notice_fee_micros")
