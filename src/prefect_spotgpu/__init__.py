"""prefect-spotgpu: a spot market for idle GPUs, used from Prefect.

Importing this package is cheap: Prefect imports it at start-up through the
``prefect.collections`` entry point, so the heavy parts load only when used.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``spot_gpu`` (``prefect_spotgpu.decorators``), imported when first asked for."""
    if name == "spot_gpu":
        from prefect_spotgpu.decorators import spot_gpu

        return spot_gpu
    raise AttributeError(f"module 'prefect_spotgpu' has no attribute {name!r}")


__all__ = ["__version__", "spot_gpu"]
