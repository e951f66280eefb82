"""The random generators' state, saved with a checkpoint so a resumed run draws the same
numbers as one never interrupted (docs/users/checkpointing.md)."""

from __future__ import annotations


def rng_state() -> dict:
    """The random generators' states: Python's, NumPy's global, torch's CPU and CUDA ones."""
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return state
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    import random

    import numpy as np

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = state["numpy"]
    np.random.set_state((numpy[0], np.asarray(numpy[1]), *numpy[2:]))
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"].clone())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.clone() for s in state["cuda"]])
