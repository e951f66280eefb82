"""Alembic environment: runs on the connection ``db.migrate`` passes in."""

from alembic import context

from prefect_spotgpu.service.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
