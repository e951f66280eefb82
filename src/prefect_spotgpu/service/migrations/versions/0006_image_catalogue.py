"""image catalogue: the operator's named images, and the images each node holds

Revision ID: 0006
Revises: 0005

``images`` is the operator's catalogue (``GET /api/v1/images``; ``spotgpu admin image``): a
name (what a deployment's ``image`` says), the reference nodes pull, the framework, its CUDA
version and a description. It is seeded with published references whose tags exist (Docker
Hub and NVIDIA NGC). They are bases: a flow runs in a job image built from one with
``docker/job.Dockerfile`` (it adds prefect-spotgpu), which the operator adds to the catalogue.
``nodes.images`` is what a node's agent last reported holding locally (placement prefers,
among equal fits, a node that already has a bid's image).
"""

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SEED = [  # name, reference, framework, CUDA, description: as published (the Python is noted:
    # a job image from docker/job.Dockerfile needs 3.11+)
    (
        "pytorch",
        "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
        "PyTorch 2.5.1",
        "12.4",
        "The PyTorch project's runtime image (cuDNN 9, Python 3.11): training and fine-tuning.",
    ),
    (
        "pytorch-devel",
        "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel",
        "PyTorch 2.5.1",
        "12.4",
        "PyTorch with the CUDA compilers and headers (Python 3.11), for extensions built at start.",
    ),
    (
        "ngc-pytorch",
        "nvcr.io/nvidia/pytorch:25.06-py3",
        "PyTorch 2.8 (NVIDIA NGC 25.06)",
        "12.9",
        "NVIDIA's PyTorch container (Python 3.12): Transformer Engine, Apex, NCCL tuned for "
        "multi-GPU training.",
    ),
    (
        "tensorrt",
        "nvcr.io/nvidia/tensorrt:25.06-py3",
        "TensorRT 10.11 (NVIDIA NGC 25.06)",
        "12.9",
        "NVIDIA TensorRT (Python 3.12): build and benchmark inference engines, batch inference.",
    ),
    (
        "huggingface",
        "huggingface/transformers-pytorch-gpu:4.41.2",
        "Transformers 4.41.2 on PyTorch",
        "12.1",
        "Hugging Face Transformers with PyTorch: fine-tuning and evaluation jobs with their own "
        "command (Python 3.10: a flow's job image needs 3.11+).",
    ),
    (
        "stable-diffusion",
        "huggingface/diffusers-pytorch-cuda:latest",
        "Diffusers on PyTorch",
        "12.1",
        "Hugging Face Diffusers (Stable Diffusion, SDXL) for render queues; published as latest "
        "only, so pin a digest for reproducible runs (Python 3.10: a flow's job image needs 3.11+).",
    ),
]


def upgrade() -> None:
    images = op.create_table(
        "images",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("reference", sa.String(500), nullable=False),
        sa.Column("framework", sa.String(100), nullable=False),
        sa.Column("cuda_version", sa.String(20)),
        sa.Column("description", sa.String(500), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_images_reference", "images", ["reference"])
    now = datetime.now(UTC)
    op.bulk_insert(
        images,
        [
            {
                "name": name,
                "reference": reference,
                "framework": framework,
                "cuda_version": cuda,
                "description": description,
                "created_at": now,
                "updated_at": now,
            }
            for name, reference, framework, cuda, description in SEED
        ],
    )
    op.add_column("nodes", sa.Column("images", sa.JSON()))


def downgrade() -> None:
    op.drop_column("nodes", "images")
    op.drop_index("ix_images_reference", "images")
    op.drop_table("images")
