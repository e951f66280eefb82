import pytest

from prefect_spotgpu.market import DEFAULT_CATALOG, GpuCatalog, GpuModel, normalize_gpu_model


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100-80G"),
        ("A100 80G", "A100-80G"),
        ("a100-80g", "A100-80G"),
        ("NVIDIA A100 80GB PCIe", "A100-80G"),
        ("A100 80 GB", "A100-80G"),
        ("NVIDIA H100 80GB HBM3", "H100-80G"),
        ("NVIDIA H100 PCIe", "H100-80G"),
        ("h100-80g", "H100-80G"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("rtx-4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 3090 Ti", "RTX-3090Ti"),
        ("RTX-3090Ti", "RTX-3090Ti"),
    ],
)
def test_names_people_and_nvml_use_normalise(spelling, canonical):
    assert normalize_gpu_model(spelling) == canonical


@pytest.mark.parametrize("name", ["NVIDIA A100-SXM4-40GB", "RTX 3090", "V100", "", "  ", "T4"])
def test_unknown_models_are_rejected_naming_the_known_ones(name):
    with pytest.raises(ValueError, match="not a known GPU model") as err:
        normalize_gpu_model(name)
    assert "A100-80G" in str(err.value)


def test_reference_prices_match_the_brief():
    prices = {m.name: m.on_demand_price for m in DEFAULT_CATALOG}
    assert prices == {
        "RTX-4090": 0.68,
        "RTX-3090Ti": 0.52,
        "A100-80G": 2.10,
        "H100-80G": 3.80,
        "H200": 4.50,
    }


def test_registering_a_model_makes_it_known_and_conflicts_fail():
    catalog = GpuCatalog.default()
    catalog.register(GpuModel("L40S", 1.10, 48))
    assert catalog.normalize("NVIDIA L40S") == "L40S"
    assert "nvidia l40s" in catalog
    with pytest.raises(ValueError, match="already names 'A100-80G'"):
        catalog.register(GpuModel("Other", 1.0, 80, aliases=("a100 80g",)))
    assert "L40S" not in DEFAULT_CATALOG  # a private catalog does not leak


@pytest.mark.parametrize("price", [0, -1, float("nan"), float("inf")])
def test_a_model_needs_a_real_price(price):
    with pytest.raises(ValueError, match="on_demand_price"):
        GpuModel("X1", price, 10)
