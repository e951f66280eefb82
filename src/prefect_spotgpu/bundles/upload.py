"""The bundle upload step of a spot-gpu pool (``prefect_spotgpu.bundles``), run by Prefect in
the caller's process environment, in a temporary directory that holds the bundle as ``FILE``:

    python -m prefect_spotgpu.bundles.upload --block NAME --key KEY FILE

It records the bundle's SHA-256 on its flow run first (label ``spotgpu.bundle-sha256``: only
the caller's Prefect credentials can set it), then writes ``bundles/KEY`` into the storage of
the Spot Checkpoint Storage block ``NAME``. Exit 1 with one line naming what failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from uuid import UUID

from prefect_spotgpu.bundles import bundle_name
from prefect_spotgpu.protocol import LABELS


def upload(block: str, key: str, file: Path) -> str:
    """Record the bundle's digest on its flow run, then store it; the digest."""
    from prefect.client.orchestration import get_client

    from prefect_spotgpu.blocks import CheckpointStorage

    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    flow_run_id = UUID(json.loads(data)["flow_run"]["id"])
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run_id, {LABELS.BUNDLE_SHA256: digest})
    CheckpointStorage.load(block).objects().put(bundle_name(key), data)
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", required=True, help="the Spot Checkpoint Storage block")
    parser.add_argument("--key", required=True, help="the bundle's key")
    parser.add_argument("file", type=Path, help="the bundle, as Prefect wrote it")
    args = parser.parse_args(argv)
    try:
        upload(args.block, args.key, args.file)
    except Exception as exc:  # one line for Prefect's "submission failed" message
        print(
            f"spotgpu: could not upload bundle {args.key} to block {args.block!r}: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
