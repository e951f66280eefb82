"""images: whether a catalogue image runs flows, or only a job's own command

Revision ID: 0012
Revises: 0011

``runs_flows`` is true for an image that holds prefect-spotgpu (the launcher a flow run's job
starts, ``python -m prefect_spotgpu.launch``): what ``spotgpu admin image build`` makes from a
base. The six published bases the catalogue was seeded with (0006) hold no prefect-spotgpu, so
they run only a job's own command: false. Every other entry is one an operator added, which
the documentation until now asked to be a job image (``docker/job.Dockerfile``): true. An
operator who added a command-only image says so again (``spotgpu admin image add NAME REF
--command-only --replace``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

SEEDED_BASES = (  # the references 0006 seeded: bases without prefect-spotgpu
    "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
    "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel",
    "nvcr.io/nvidia/pytorch:25.06-py3",
    "nvcr.io/nvidia/tensorrt:25.06-py3",
    "huggingface/transformers-pytorch-gpu:4.41.2",
    "huggingface/diffusers-pytorch-cuda:latest",
)


def upgrade() -> None:
    op.add_column(
        "images",
        sa.Column("runs_flows", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    images = sa.table("images", sa.column("reference", sa.String), sa.column("runs_flows"))
    op.execute(
        images.update().where(images.c.reference.not_in(SEEDED_BASES)).values(runs_flows=sa.true())
    )


def downgrade() -> None:
    op.drop_column("images", "runs_flows")
