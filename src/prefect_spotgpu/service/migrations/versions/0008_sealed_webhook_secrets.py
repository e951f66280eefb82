"""sealed webhook secrets: ``tenants.webhook_secret`` becomes TEXT, for a sealed value

Revision ID: 0008
Revises: 0007

A tenant's webhook signing secret is kept sealed, as a bid's job environment is: ``sealed:`` and
a Fernet token (service/sealing.py), longer than the 200 characters a plaintext secret had. The
rows written in the clear before this are sealed by the service when it starts
(``sealing.seal_plaintext_webhook_secrets``, beside ``seal_plaintext_jobs``): migrations have no
key. A sealed value is recognisable by its prefix, so sealing twice is a no-op.

SQLite cannot change a column's type in place, and a batch copy of ``tenants`` would trip the
foreign keys of every table that references it: the column is copied into a new one, dropped
and the new one renamed (plain ADD, DROP and RENAME COLUMN).

The downgrade cannot open sealed secrets (no key either): it clears them, so a tenant whose
secret was sealed sets it again; plaintext ones are kept.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _retype(type_: sa.types.TypeEngine) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column("tenants", "webhook_secret", type_=type_)
        return
    op.add_column("tenants", sa.Column("webhook_secret_new", type_))
    op.execute("UPDATE tenants SET webhook_secret_new = webhook_secret")
    op.drop_column("tenants", "webhook_secret")
    op.execute("ALTER TABLE tenants RENAME COLUMN webhook_secret_new TO webhook_secret")


def upgrade() -> None:
    _retype(sa.Text())


def downgrade() -> None:
    op.execute(
        "UPDATE tenants SET webhook_secret = NULL WHERE substr(webhook_secret, 1, 7) = 'sealed:'"
    )
    _retype(sa.String(length=200))
