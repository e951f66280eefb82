"""The checkpoint format: tensor bytes back to back in one blob, and a small JSON manifest.

The manifest records the state's tree (dicts, lists, tuples, scalars), and for every array or
tensor its library, dtype, shape, offset and CRC32; other Python objects are pickled into the
blob with a CRC32 of their own. The manifest carries a CRC32 of itself. A checkpoint whose
manifest or any leaf fails its check is never returned: ``decode`` raises ``CorruptCheckpoint``.

torch is optional: tensors are handled when torch is importable, NumPy arrays always.
"""

from __future__ import annotations

import json
import pickle
import zlib
from dataclasses import dataclass, field

import numpy as np

FORMAT = "spotgpu-checkpoint/1"
ALIGN = 64


class CorruptCheckpoint(Exception):
    """A checkpoint failed verification (torn write, flipped byte, wrong format)."""


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


@dataclass
class Encoded:
    """A state ready to write: the buffers of the blob, in order, and the manifest.

    Checksums are left for :meth:`fill_checksums`, so they can be computed in a second
    thread while the buffers are written (both release the GIL).
    """

    buffers: list[memoryview] = field(default_factory=list)
    size: int = 0
    manifest: dict = field(default_factory=dict)
    pending: list[tuple[dict, memoryview]] = field(default_factory=list)

    def fill_checksums(self) -> None:
        for node, view in self.pending:
            node["crc32"] = zlib.crc32(view)
        self.pending = []

    def manifest_bytes(self) -> bytes:
        if self.pending:
            self.fill_checksums()
        body = json.dumps(self.manifest, sort_keys=True, separators=(",", ":")).encode()
        crc = zlib.crc32(body)
        return json.dumps(
            {"crc32": crc, "manifest": self.manifest}, sort_keys=True, separators=(",", ":")
        ).encode()


class _Encoder:
    def __init__(self) -> None:
        self.out = Encoded()

    def _append(self, view: memoryview) -> tuple[int, int]:
        pad = (-self.out.size) % ALIGN
        if pad:
            self.out.buffers.append(memoryview(bytes(pad)))
            self.out.size += pad
        offset = self.out.size
        self.out.buffers.append(view)
        self.out.size += view.nbytes
        return offset, view.nbytes

    def leaf_array(self, array: np.ndarray, lib: str, dtype: str, shape) -> dict:
        array = np.ascontiguousarray(array)
        view = memoryview(array).cast("B") if array.nbytes else memoryview(b"")
        offset, length = self._append(view)
        node = {
            "t": "array",
            "lib": lib,
            "dtype": dtype,
            "shape": list(shape),
            "offset": offset,
            "length": length,
            "crc32": None,
        }
        self.out.pending.append((node, view))
        return node

    def encode(self, value):
        torch = _torch()
        if value is None or isinstance(value, bool | int | str):
            return {"t": "v", "v": value}
        if isinstance(value, float):
            return {"t": "f", "v": value.hex()}  # exact, NaN and infinities included
        if isinstance(value, np.ndarray) and value.dtype != object:
            return self.leaf_array(value, "numpy", value.dtype.str, value.shape)
        if torch is not None and isinstance(value, torch.Tensor):
            tensor = value.detach()
            if tensor.device.type == "cuda":  # device -> pinned host memory: the fast copy
                staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                staging.copy_(tensor, non_blocking=True)
                torch.cuda.current_stream(tensor.device).synchronize()
                tensor = staging
            elif tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            if tensor.dtype in (torch.bfloat16,) or not _numpy_has(tensor.dtype):
                raw = (
                    tensor.view(torch.uint8)
                    if tensor.dim()
                    else tensor.reshape(1).view(torch.uint8)
                )
                array = raw.numpy()
            else:
                array = tensor.numpy()
            return self.leaf_array(array, "torch", dtype, tensor.shape)
        if isinstance(value, dict) and all(isinstance(k, str | int) for k in value):
            return {"t": "dict", "items": [[k, self.encode(v)] for k, v in value.items()]}
        if isinstance(value, list):
            return {"t": "list", "items": [self.encode(v) for v in value]}
        if isinstance(value, tuple) and type(value) is tuple:
            return {"t": "tuple", "items": [self.encode(v) for v in value]}
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        offset, length = self._append(view)
        node = {"t": "pickle", "offset": offset, "length": length, "crc32": None}
        self.out.pending.append((node, view))
        return node


def _numpy_has(dtype) -> bool:
    torch = _torch()
    return dtype not in (
        torch.bfloat16,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )


def encode(state, *, step: int, extra: dict | None = None) -> Encoded:
    """Lay ``state`` out as one blob of buffers and its manifest (no bytes are copied)."""
    encoder = _Encoder()
    tree = encoder.encode(state)
    encoder.out.manifest = {
        "format": FORMAT,
        "step": step,
        "size": encoder.out.size,
        "tree": tree,
        "extra": extra or {},
    }
    return encoder.out


def read_manifest(raw: bytes) -> dict:
    try:
        outer = json.loads(raw)
        manifest = outer["manifest"]
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"unreadable manifest: {exc}") from None
    if zlib.crc32(body) != outer.get("crc32"):
        raise CorruptCheckpoint("manifest checksum mismatch")
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"unknown format {manifest.get('format')!r}")
    return manifest


def decode(manifest: dict, blob) -> object:
    """Rebuild the state from its manifest and blob, checking every leaf's CRC32."""
    view = memoryview(blob)
    if view.nbytes != manifest["size"]:
        raise CorruptCheckpoint(f"blob is {view.nbytes} bytes, manifest says {manifest['size']}")
    torch = _torch()

    def leaf(node):
        part = view[node["offset"] : node["offset"] + node["length"]]
        if zlib.crc32(part) != node["crc32"]:
            raise CorruptCheckpoint(f"checksum mismatch at offset {node['offset']}")
        return part

    def build(node):
        kind = node["t"]
        if kind == "v":
            return node["v"]
        if kind == "f":
            return float.fromhex(node["v"])
        if kind == "dict":
            return {k: build(v) for k, v in node["items"]}
        if kind == "list":
            return [build(v) for v in node["items"]]
        if kind == "tuple":
            return tuple(build(v) for v in node["items"])
        if kind == "pickle":
            return pickle.loads(leaf(node))
        if kind == "array":
            part = leaf(node)
            if node["lib"] == "numpy":
                return np.frombuffer(part, dtype=np.dtype(node["dtype"])).reshape(node["shape"])
            if torch is None:
                raise CorruptCheckpoint("this checkpoint holds torch tensors: install torch")
            dtype = getattr(torch, node["dtype"])
            flat = (
                torch.frombuffer(part, dtype=torch.uint8)
                if node["length"]
                else torch.empty(0, dtype=torch.uint8)
            )
            return (
                flat.view(dtype).reshape(node["shape"])
                if node["length"]
                else torch.empty(node["shape"], dtype=dtype)
            )
        raise CorruptCheckpoint(f"unknown node type {kind!r}")

    return build(manifest["tree"])
