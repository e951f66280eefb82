"""What GPUs this host has: NVML (nvidia-ml-py), or an inventory declared by hand.

A declared inventory (``--gpus A100-80G:2``) is for machines without NVIDIA GPUs (development,
CI); the node's record says it was declared. NVML is never faked: where it is missing and no
inventory is declared, discovery fails with a clear error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from prefect_spotgpu.market import DEFAULT_CATALOG, MAX_GPUS_PER_NODE


class DiscoveryError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    model: str  # the market's canonical name
    name: str  # as the driver reports it
    uuid: str
    memory_mb: int
    driver: str | None = None
    mig_mode: bool | None = None
    ecc_errors: int | None = None
    throttle_reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def parse_declared(spec: str) -> list[GpuInfo]:
    """``"A100-80G:2"`` -> two declared A100-80G GPUs (the model name is normalised)."""
    model, sep, count = spec.rpartition(":")
    if not sep or not model:
        raise DiscoveryError(f"--gpus must look like MODEL:COUNT, e.g. A100-80G:2, got {spec!r}")
    try:
        n = int(count)
    except ValueError:
        raise DiscoveryError(f"--gpus count must be an integer, got {count!r}") from None
    if not 1 <= n <= MAX_GPUS_PER_NODE:
        raise DiscoveryError(f"--gpus count must be between 1 and {MAX_GPUS_PER_NODE}, got {n}")
    try:
        canonical = DEFAULT_CATALOG.normalize(model)
    except ValueError as exc:
        raise DiscoveryError(str(exc)) from None
    memory = DEFAULT_CATALOG.get(canonical).memory_gb * 1024
    return [
        GpuInfo(i, canonical, f"declared {canonical}", f"declared-{i}", memory) for i in range(n)
    ]


_THROTTLE = {
    0x0000000000000002: "applications_clocks_setting",
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal_slowdown",
    0x0000000000000040: "hw_thermal_slowdown",
    0x0000000000000080: "hw_power_brake_slowdown",
}


def discover_nvml(nvml=None) -> list[GpuInfo]:
    """The GPUs NVML reports, with their names normalised to the market's models.

    ``nvml`` is the ``pynvml`` module (a seam for tests on machines without a GPU).
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
            raise DiscoveryError("nvidia-ml-py is not installed") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise DiscoveryError(
            f"NVML is not available ({exc}); on a machine without NVIDIA GPUs declare an "
            "inventory with --gpus MODEL:COUNT"
        ) from None
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(nvml.nvmlDeviceGetName(handle))
            try:
                model = DEFAULT_CATALOG.normalize(name)
            except ValueError as exc:
                raise DiscoveryError(f"GPU {i}: {exc}") from None
            memory = nvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            gpus.append(
                GpuInfo(
                    index=i,
                    model=model,
                    name=name,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    memory_mb=int(memory),
                    driver=driver,
                    mig_mode=_try(lambda h=handle: bool(nvml.nvmlDeviceGetMigMode(h)[0])),
                    ecc_errors=_try(
                        lambda h=handle: int(
                            nvml.nvmlDeviceGetTotalEccErrors(
                                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                            )
                        )
                    ),
                    throttle_reasons=_throttle(nvml, handle),
                )
            )
        if not gpus:
            raise DiscoveryError("NVML reports no GPUs on this host")
        models = {g.model for g in gpus}
        if len(models) > 1:
            raise DiscoveryError(f"a node sells one GPU model; this host has {sorted(models)}")
        return gpus
    finally:
        _try(nvml.nvmlShutdown)


def telemetry_nvml(nvml=None) -> list[dict]:
    """Utilisation, memory used, power and temperature of each GPU, for heartbeats."""
    if nvml is None:
        import pynvml as nvml
    out = []
    nvml.nvmlInit()
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            out.append(
                {
                    "index": i,
                    "utilization": _try(lambda h=handle: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                    "memory_used_mb": _try(
                        lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).used // (1024 * 1024)
                    ),
                    "power_w": _try(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                    "temperature_c": _try(
                        lambda h=handle: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                    ),
                }
            )
    finally:
        _try(nvml.nvmlShutdown)
    return out


def _throttle(nvml, handle) -> list[str]:
    mask = _try(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)) or 0
    return [name for bit, name in _THROTTLE.items() if mask & bit]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn):
    try:
        return fn()
    except Exception:
        return None
