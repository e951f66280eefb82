"""nodes: a Docker node's job network; allocations: a job's address on it

Revision ID: 0014
Revises: 0013

``nodes.job_subnet`` is the IPv4 subnet of a Docker node's job network (``spotgpu agent start
--job-subnet``), NULL for every node registered before and for every node without one: its
containers stay on Docker's default bridge and it runs no gang member in a container, as
before. ``allocations.job_address`` is the address the service gave an allocation on its
node's job network (NULL: the node has none): a gang's members reach each other there.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("job_subnet", sa.String(length=18), nullable=True))
    op.add_column("allocations", sa.Column("job_address", sa.String(length=15), nullable=True))


def downgrade() -> None:
    op.drop_column("allocations", "job_address")
    op.drop_column("nodes", "job_subnet")
