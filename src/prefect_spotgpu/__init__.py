"""prefect-spotgpu: a spot market for idle GPUs, used from Prefect.

Importing this package is cheap: Prefect imports it at start-up through the
``prefect.collections`` entry point, so the heavy parts load only when used.
"""

__version__ = "0.1.0"
