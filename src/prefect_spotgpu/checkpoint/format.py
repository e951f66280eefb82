"""The checkpoint format: tensor bytes back to back in one blob, and a small JSON manifest.

The manifest records the state's tree (dicts, lists, tuples, scalars), and for every array or
tensor its library, dtype, shape, offset and checksum; other Python objects are pickled into
the blob with a checksum of their own. The manifest carries a CRC32 of itself. Four versions,
each named by its leaves' checksum; a reader takes all four:

- ``spotgpu-checkpoint/3``: every leaf has an XXH3-64 (catches torn writes and flipped bits,
  at ~19 GB/s a core where CRC32 runs at ~4: ``xxhash``); what an unsigned save writes;
- ``spotgpu-checkpoint/4``: every leaf has a BLAKE3 instead (a cryptographic hash, ~4 GB/s a
  core where SHA-256 runs at ~1.8: ``blake3``), and the manifest is signed: ``hmac_sha256``
  beside it is HMAC-SHA256 over the manifest, the checkpoint's key and its step
  (:func:`signature`), so a signed checkpoint cannot be altered, nor moved to another key or
  step, without the signing key; what a signed save writes. A fast checksum is no defence
  against someone who can write the storage (it is easily forged); a BLAKE3 under a signed
  manifest is;
- ``spotgpu-checkpoint/1`` (CRC32 leaves) and ``/2`` (SHA-256 leaves, signed): what earlier
  versions wrote, and what a save writes where ``xxhash`` or ``blake3`` cannot be imported.

A checkpoint whose manifest or any leaf fails its check is never returned: ``read_manifest``
and ``decode`` raise ``CorruptCheckpoint`` (or a subclass), and ``decode`` checks every leaf
before it unpickles anything.

torch is optional: tensors are handled when torch is importable, NumPy arrays always.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

FORMAT = "spotgpu-checkpoint/1"
FORMAT_SIGNED = "spotgpu-checkpoint/2"
FORMAT_FAST = "spotgpu-checkpoint/3"
FORMAT_SIGNED_FAST = "spotgpu-checkpoint/4"
DIGESTS = {FORMAT: "crc32", FORMAT_SIGNED: "sha256", FORMAT_FAST: "xxh3",
           FORMAT_SIGNED_FAST: "blake3"}  # fmt: skip
"""Each format's leaf checksum."""
FORMATS = tuple(DIGESTS)
SIGNED_FORMATS = (FORMAT_SIGNED, FORMAT_SIGNED_FAST)
SIGNATURE_FIELD = "hmac_sha256"
SIGNATURE_CONTEXT = "spotgpu-checkpoint-signature/1"
ALIGN = 64


class CorruptCheckpoint(Exception):
    """A checkpoint failed verification (torn write, flipped byte, wrong format)."""


class UnreadableCheckpoint(CorruptCheckpoint):
    """A listed checkpoint cannot be read: its blob or manifest is missing (the storage
    layer maps its own "not found" errors, such as S3's ``NoSuchKey``, to this)."""


class UntrustedCheckpoint(CorruptCheckpoint):
    """A checkpoint is unsigned, or not signed with this checkpointer's key."""


def signature(key: bytes, name: str, step: int, body: bytes) -> str:
    """HMAC-SHA256 (hex) of a manifest's canonical ``body``, bound to its key and step."""
    context = json.dumps([SIGNATURE_CONTEXT, name, step]).encode()
    return hmac.new(key, context + b"\n" + body, hashlib.sha256).hexdigest()


def _canonical(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _torch_if_imported():
    """torch, if the process has imported it (a state can hold a tensor only then); never
    imports it: a NumPy-only flow would pay seconds for an import it does not need."""
    return sys.modules.get("torch")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


@dataclass
class Part:
    """One leaf's bytes in the blob: at ``offset``, ``nbytes`` long, from ``source``: a
    memoryview of host memory, or a flat ``uint8`` view of a CUDA tensor (copied to host
    memory when the blob is made: :meth:`Encoded.materialize`, or ``staging.stage``)."""

    offset: int
    nbytes: int
    source: object
    node: dict


@dataclass
class Encoded:
    """A state laid out as one blob: its ``parts`` at their offsets, and the manifest.

    ``buffers`` (the blob, in order, to write) exist once the parts are in host memory:
    :meth:`materialize` points them at the state's own memory (a synchronous save: no copy
    but the device-to-host one), ``checkpoint.staging.stage`` copies them into reused
    buffers (a snapshot an asynchronous save writes while training goes on). Checksums are
    left for :meth:`fill_checksums`, so they can be computed in a second thread while the
    buffers are written (both release the GIL). ``digest`` is the format's leaf checksum
    (``DIGESTS``).
    """

    buffers: list[memoryview] = field(default_factory=list)
    size: int = 0
    manifest: dict = field(default_factory=dict)
    pending: list[tuple[dict, memoryview]] = field(default_factory=list)
    digest: str = "crc32"
    parts: list[Part] = field(default_factory=list)

    def materialize(self) -> Encoded:
        """Buffers over the state's own memory (CUDA tensors copied to pinned host memory,
        one synchronisation for all), padding between them; returns ``self``."""
        host: list[memoryview] = []
        devices = [part for part in self.parts if not isinstance(part.source, memoryview)]
        copies = {}
        if devices:
            torch = _torch()
            for part in devices:
                staging = torch.empty(part.nbytes, dtype=torch.uint8, pin_memory=True)
                staging.copy_(part.source, non_blocking=True)
                copies[id(part)] = staging
            for device in {part.source.device for part in devices}:
                torch.cuda.synchronize(device)  # one wait per GPU for all of its copies
        at = 0
        for part in self.parts:
            if part.offset > at:
                host.append(memoryview(bytes(part.offset - at)))
            view = part.source if id(part) not in copies else memoryview(copies[id(part)].numpy())
            host.append(view)
            self.pending.append((part.node, view))
            at = part.offset + part.nbytes
        self.buffers = host
        return self

    def fill_checksums(self) -> None:
        for node, view in self.pending:
            node[self.digest] = _digest(self.digest, view)
        self.pending = []

    def manifest_bytes(self, sign: Callable[[bytes], str] | None = None) -> bytes:
        """The manifest as stored; ``sign`` (see :func:`signature`) signs its body."""
        if self.pending:
            self.fill_checksums()
        body = _canonical(self.manifest)
        outer: dict = {"crc32": zlib.crc32(body), "manifest": self.manifest}
        if sign is not None:
            outer[SIGNATURE_FIELD] = sign(body)
        return json.dumps(outer, sort_keys=True, separators=(",", ":")).encode()


def _digest(kind: str, view) -> int | str:
    if kind == "xxh3":
        return _hashes().xxh3_64_intdigest(view)
    if kind == "blake3":
        return _blake3()(view).hexdigest()
    if kind == "sha256":
        return hashlib.sha256(view).hexdigest()
    return zlib.crc32(view)


def _hashes():
    try:
        import xxhash
    except ImportError:
        raise ImportError(
            "this checkpoint's leaves are checked with XXH3 (format 3): pip install xxhash"
        ) from None
    return xxhash


def _blake3():
    try:
        from blake3 import blake3
    except ImportError:
        raise ImportError(
            "this checkpoint's leaves are checked with BLAKE3 (format 4): pip install blake3"
        ) from None
    return blake3


def writing_format(signed: bool) -> str:
    """The format a save writes: 3 (XXH3 leaves) or, ``signed``, 4 (BLAKE3); 1 or 2 where
    ``xxhash`` or ``blake3`` cannot be imported (a job image without them)."""
    try:
        _blake3() if signed else _hashes()
    except ImportError:
        return FORMAT_SIGNED if signed else FORMAT
    return FORMAT_SIGNED_FAST if signed else FORMAT_FAST


class _Encoder:
    def __init__(self) -> None:
        self.out = Encoded()

    def _append(self, source, nbytes: int, node: dict) -> dict:
        offset = self.out.size + (-self.out.size) % ALIGN
        node["offset"], node["length"] = offset, nbytes
        self.out.parts.append(Part(offset, nbytes, source, node))
        self.out.size = offset + nbytes
        return node

    def leaf_array(self, array: np.ndarray, lib: str, dtype: str, shape) -> dict:
        array = np.ascontiguousarray(array)
        view = memoryview(array).cast("B") if array.nbytes else memoryview(b"")
        node = {"t": "array", "lib": lib, "dtype": dtype, "shape": list(shape)}
        return self._append(view, array.nbytes, node | {self.out.digest: None})

    def encode(self, value):
        torch = _torch_if_imported()
        if value is None or isinstance(value, bool | int | str):
            return {"t": "v", "v": value}
        if isinstance(value, float):
            return {"t": "f", "v": value.hex()}  # exact, NaN and infinities included
        if isinstance(value, np.ndarray) and value.dtype != object:
            return self.leaf_array(value, "numpy", value.dtype.str, value.shape)
        if torch is not None and isinstance(value, torch.Tensor):
            return self.leaf_tensor(torch, value.detach())
        if isinstance(value, dict) and all(isinstance(k, str | int) for k in value):
            return {"t": "dict", "items": [[k, self.encode(v)] for k, v in value.items()]}
        if isinstance(value, list):
            return {"t": "list", "items": [self.encode(v) for v in value]}
        if isinstance(value, tuple) and type(value) is tuple:
            return {"t": "tuple", "items": [self.encode(v) for v in value]}
        data = memoryview(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        return self._append(data, data.nbytes, {"t": "pickle", self.out.digest: None})

    def leaf_tensor(self, torch, tensor) -> dict:
        if tensor.device.type not in ("cpu", "cuda"):
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.device.type == "cuda":  # copied to host memory when the blob is made
            flat = tensor.reshape(-1).view(torch.uint8)
            node = {"t": "array", "lib": "torch", "dtype": dtype, "shape": list(tensor.shape)}
            return self._append(flat, flat.numel(), node | {self.out.digest: None})
        if tensor.dtype in (torch.bfloat16,) or not _numpy_has(tensor.dtype):
            raw = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
            array = raw.numpy()
        else:
            array = tensor.numpy()
        return self.leaf_array(array, "torch", dtype, tensor.shape)


def _numpy_has(dtype) -> bool:
    torch = _torch()
    return dtype not in (
        torch.bfloat16,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )


def layout(state, *, step: int, extra: dict | None = None, signed: bool = False) -> Encoded:
    """Lay ``state`` out as one blob of parts and its manifest, copying nothing: the parts
    are made host buffers by :meth:`Encoded.materialize` or ``staging.stage``.

    ``signed``: format 4 (BLAKE3 leaves), for a manifest that will be signed.
    """
    encoder = _Encoder()
    written = writing_format(signed)
    encoder.out.digest = DIGESTS[written]
    tree = encoder.encode(state)
    encoder.out.manifest = {
        "format": written,
        "step": step,
        "size": encoder.out.size,
        "tree": tree,
        "extra": extra or {},
    }
    return encoder.out


def encode(state, *, step: int, extra: dict | None = None, signed: bool = False) -> Encoded:
    """Lay ``state`` out as one blob of buffers over its own memory, and its manifest (no
    host bytes are copied; CUDA tensors go to pinned host memory).

    ``signed``: format 4 (BLAKE3 leaves), for a manifest that will be signed.
    """
    return layout(state, step=step, extra=extra, signed=signed).materialize()


def read_manifest(
    raw: bytes, *, key: bytes | None = None, name: str | None = None, step: int | None = None
) -> dict:
    """The manifest in ``raw``, checked: its CRC32, its format and (given ``step``) that it
    is the manifest of that step. With a signing ``key``, it must also be signed with that key
    for checkpoint ``name`` at ``step`` (compared in constant time), or
    ``UntrustedCheckpoint`` is raised: unsigned and mis-signed manifests are refused alike.
    """
    try:
        outer = json.loads(raw)
        manifest = outer["manifest"]
        body = _canonical(manifest)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"unreadable manifest: {exc}") from None
    if key is not None:
        if name is None or step is None:
            raise ValueError("checking a signature needs the checkpoint's name and step")
        claimed = outer.get(SIGNATURE_FIELD)
        if not isinstance(claimed, str):
            raise UntrustedCheckpoint("the manifest is not signed")
        expected = signature(key, name, step, body)
        if not hmac.compare_digest(claimed.encode(), expected.encode()):
            raise UntrustedCheckpoint("the manifest's signature does not match this run's key")
    if zlib.crc32(body) != outer.get("crc32"):
        raise CorruptCheckpoint("manifest checksum mismatch")
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CorruptCheckpoint(f"unknown format {found!r}")
    if key is not None and manifest["format"] not in SIGNED_FORMATS:
        raise UntrustedCheckpoint(f"a signed checkpoint must be {' or '.join(SIGNED_FORMATS)}")
    if step is not None and manifest.get("step") != step:
        raise CorruptCheckpoint(f"the manifest is of step {manifest.get('step')!r}")
    return manifest


def verify(manifest: dict, blob) -> None:
    """Check the blob's size and every leaf's checksum (the format's: ``DIGESTS``),
    unpickling nothing; raises ``CorruptCheckpoint``."""
    view = memoryview(blob)
    kind = DIGESTS.get(manifest.get("format"), "crc32")
    try:
        if view.nbytes != manifest["size"]:
            raise CorruptCheckpoint(
                f"blob is {view.nbytes} bytes, manifest says {manifest['size']}"
            )
        stack = [manifest["tree"]]
        while stack:
            node = stack.pop()
            if node["t"] == "dict":
                stack.extend(v for _, v in node["items"])
            elif node["t"] in ("list", "tuple"):
                stack.extend(node["items"])
            elif node["t"] in ("array", "pickle"):
                part = view[node["offset"] : node["offset"] + node["length"]]
                if node.get(kind) is None or _digest(kind, part) != node[kind]:
                    raise CorruptCheckpoint(f"checksum mismatch at offset {node['offset']}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpoint(f"malformed manifest: {type(exc).__name__}: {exc}") from None


def decode(manifest: dict, blob) -> object:
    """Rebuild the state from its manifest and blob once :func:`verify` has checked every
    leaf. Any failure to rebuild (a class that no longer unpickles, a malformed tree) raises
    ``CorruptCheckpoint``, so the caller can fall back to an older checkpoint."""
    verify(manifest, blob)
    try:
        return _build(manifest, memoryview(blob))
    except (CorruptCheckpoint, MemoryError):
        raise
    except Exception as exc:
        raise CorruptCheckpoint(f"cannot rebuild the state: {type(exc).__name__}: {exc}") from exc


def _build(manifest: dict, view: memoryview) -> object:
    torch = None  # imported at the first tensor: a NumPy-only checkpoint never imports it

    def leaf(node):
        return view[node["offset"] : node["offset"] + node["length"]]

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
            nonlocal torch
            torch = torch or _torch()
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
