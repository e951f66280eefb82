"""An image pull's progress as the agent reports it: the Docker engine's pull messages folded
into byte and layer counts, and the one plain line a ``pulling`` report carries. Pure: the
runner reads the engine and the clock and says when to report (``DockerRunner.prepare``).

Bytes are the compressed bytes downloaded, summed over the layers this node lacked (a layer
it has already is done and counts no bytes); a total with ``+`` still misses a layer whose
size the engine has not said yet (no percentage until every size is known).

    >>> pull = PullProgress("registry.local:5000/pytorch:2.5")
    >>> for message in [
    ...     {"status": "Pulling from pytorch", "id": "2.5"},
    ...     {"status": "Already exists", "progressDetail": {}, "id": "a1"},
    ...     {"status": "Pulling fs layer", "progressDetail": {}, "id": "b2"},
    ...     {"status": "Pulling fs layer", "progressDetail": {}, "id": "c3"},
    ...     {"status": "Downloading", "progressDetail": {"current": 400_000_000,
    ...                                                   "total": 1_200_000_000}, "id": "b2"},
    ... ]:
    ...     pull.add(message)
    >>> pull.line()
    'pulling registry.local:5000/pytorch:2.5: 0.4 of 1.2+ GB, 1 of 3 layers done'
    >>> pull.add({"status": "Downloading", "progressDetail": {"current": 1_000,
    ...                                                       "total": 800_000_000}, "id": "c3"})
    >>> pull.line()
    'pulling registry.local:5000/pytorch:2.5: 0.4 of 2.0 GB (20 %), 1 of 3 layers done'
    >>> for layer in ("b2", "c3"):
    ...     pull.add({"status": "Pull complete", "progressDetail": {}, "id": layer})
    >>> pull.done_line(seconds=12.34)
    'pulled registry.local:5000/pytorch:2.5 in 12.3 s (2.0 GB in 2 new layers, 3 in all)'
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect_spotgpu.agent.reports import one_line

SHOWN_REFERENCE_CHARS = 160
"""The most of a reference a line shows (a longer one is cut in its middle): the counts after
it must fit the report's ``REPORT_DETAIL_CHARS``."""

_DONE = frozenset({"Pull complete", "Already exists"})
_DOWNLOADED = frozenset({"Download complete", "Verifying Checksum", "Extracting", "Pull complete"})


@dataclass
class Layer:
    total: int | None = None  # compressed size, once the engine says it
    current: int = 0  # bytes downloaded
    done: bool = False
    existed: bool = False  # on the node already: no bytes to fetch


class PullProgress:
    """The layers of one pull of ``reference``, from the engine's messages (``add``)."""

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self.layers: dict[str, Layer] = {}

    def add(self, message: dict) -> None:
        """Fold in one message of ``client.api.pull(..., stream=True, decode=True)``; messages
        about the image itself ("Pulling from", "Digest", "Status") change nothing."""
        layer_id, status = message.get("id"), str(message.get("status") or "")
        if not isinstance(layer_id, str) or not status or status.startswith("Pulling from"):
            return
        layer = self.layers.setdefault(layer_id, Layer())
        detail = message.get("progressDetail") or {}
        if status == "Already exists":
            layer.existed = True
        elif status == "Downloading":
            layer.total = _count(detail.get("total")) or layer.total
            layer.current = max(layer.current, _count(detail.get("current")) or 0)
        if status in _DOWNLOADED and layer.total is not None:
            layer.current = layer.total
        if status in _DONE:
            layer.done = True

    @property
    def downloaded(self) -> int:
        return sum(layer.current for layer in self.layers.values() if not layer.existed)

    def line(self) -> str:
        """How far the pull is, as one line (``pulling REF: 0.4 of 1.2 GB (33 %), 1 of 3
        layers done``)."""
        fetched = [layer for layer in self.layers.values() if not layer.existed]
        total = sum(layer.total or 0 for layer in fetched)
        unsized = any(layer.total is None and not layer.done for layer in fetched)
        done = sum(layer.done for layer in self.layers.values())
        layers = f"{done} of {len(self.layers)} layers done"
        if not total:
            return one_line(f"pulling {_shown(self.reference)}: {layers}")
        unit, scale = _unit(total)
        amount = f"{self.downloaded / scale:.1f} of {total / scale:.1f}"
        if unsized:
            sizes = f"{amount}+ {unit}"
        else:
            sizes = f"{amount} {unit} ({100 * self.downloaded // total} %)"
        return one_line(f"pulling {_shown(self.reference)}: {sizes}, {layers}")

    def done_line(self, *, seconds: float) -> str:
        """The pull's last line: how long it took, what it fetched."""
        new = sum(not layer.existed for layer in self.layers.values())
        return one_line(
            f"pulled {_shown(self.reference)} in {seconds:.1f} s ({_size(self.downloaded)} "
            f"in {new} new {'layer' if new == 1 else 'layers'}, {len(self.layers)} in all)"
        )


def _count(value) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _unit(total: int) -> tuple[str, float]:
    """The decimal unit a size is shown in (as Docker shows them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return unit, scale
    return "B", 1.0


def _size(count: int) -> str:
    unit, scale = _unit(count)
    return f"{count} B" if unit == "B" else f"{count / scale:.1f} {unit}"


def _shown(reference: str) -> str:
    if len(reference) <= SHOWN_REFERENCE_CHARS:
        return reference
    half = (SHOWN_REFERENCE_CHARS - 3) // 2
    return f"{reference[:half]}...{reference[-half:]}"
