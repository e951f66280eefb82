"""A framework's checkpoint directory as one of this project's checkpoints, and back.

Hugging Face's ``Trainer`` writes ``checkpoint-<step>/`` (weights, optimizer, scheduler, RNG
states, trainer state), Lightning a ``.ckpt`` file: each framework's own format, which its own
``resume_from_checkpoint`` / ``ckpt_path`` reads. The integrations (``huggingface``,
``lightning``) keep that format and store it through a ``Checkpointer``: every file of the
directory becomes one leaf of the state (its bytes, checksummed; the manifest signed with the
run's key), so the storage's promises hold for it — committed atomically, verified before a
byte is written back, retention, the acknowledgement after the durable final save.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path, PurePosixPath

import numpy as np

FILES = "files"
"""The state's one key: relative path -> the file's bytes."""


def directory_state(root: Path) -> dict:
    """Every regular file under ``root``, by its path relative to it, as bytes mapped from the
    file (no copy; valid while the files are)."""
    files = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and not path.is_symlink():
            relative = path.relative_to(root).as_posix()
            size = path.stat().st_size
            if size == 0:
                files[relative] = np.zeros(0, dtype=np.uint8)
                continue
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            files[relative] = np.frombuffer(mapped, dtype=np.uint8)
    return {FILES: files}


def write_directory(state: object, root: Path) -> Path:
    """Write a restored :func:`directory_state` under ``root`` (created); ``root``. A path
    that would leave ``root`` is refused (``ValueError``), whatever the checkpoint says."""
    files = state.get(FILES) if isinstance(state, dict) else None
    if not isinstance(files, dict):
        raise ValueError("not a checkpoint of a directory: it has no files")
    root = Path(root)
    for relative, data in files.items():
        parts = PurePosixPath(relative).parts
        if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
            raise ValueError(f"refused a file outside the checkpoint's directory: {relative!r}")
        target = root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    return root
