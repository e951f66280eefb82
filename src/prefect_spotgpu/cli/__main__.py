"""``python -m prefect_spotgpu.cli``: the ``spotgpu`` command."""

from prefect_spotgpu.cli.app import app

app()
