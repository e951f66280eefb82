"""Save the block documents the example deployments use (deployments/prefect.yaml).

    python blocks/save_blocks.py --market-url http://127.0.0.1:4300 --api-key-file ~/alice.key \
        --checkpoints /mnt/shared/checkpoints
    SPOTGPU_API_KEY=sgk_... python blocks/save_blocks.py --bucket my-ckpts --prefix runs \
        --endpoint-url http://minio:9000          # S3 credentials from AWS_* variables

Saves two documents, overwriting earlier ones of the same names:
  Spot Market "spot-market"               the market's URL and your tenant API key
  Spot Checkpoint Storage "spot-checkpoints"   a shared directory, or an S3 bucket/prefix
Run it against the Prefect API the worker uses (PREFECT_API_URL). The installed package has the
same as a command: spotgpu blocks save. The key comes from a file or SPOTGPU_API_KEY, never
argv (every user of the host can read a command line).
"""

from __future__ import annotations

import argparse
import os

from prefect_spotgpu.cli.pool import save_blocks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--market-url", default=os.environ.get("SPOTGPU_MARKET_URL", "http://127.0.0.1:4300")
    )
    parser.add_argument(
        "--api-key-file", help="a file holding your tenant key (default: SPOTGPU_API_KEY)"
    )
    parser.add_argument("--checkpoints", help="a directory every node reaches")
    parser.add_argument("--bucket", help="an S3 bucket instead of a directory")
    parser.add_argument("--prefix", default="", help="key prefix in the bucket")
    parser.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL_S3"))
    parser.add_argument("--market-name", default="spot-market")
    parser.add_argument("--storage-name", default="spot-checkpoints")
    args = parser.parse_args(argv)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            api_key = f.read().strip()
    else:
        api_key = os.environ.get("SPOTGPU_API_KEY", "")
    if not api_key:
        parser.error("no API key: set SPOTGPU_API_KEY or pass --api-key-file")
    if (args.checkpoints is None) == (args.bucket is None):
        parser.error("give --checkpoints DIR or --bucket NAME")

    save_blocks(
        market_url=args.market_url,
        api_key=api_key,
        checkpoints=args.checkpoints,
        bucket=args.bucket,
        prefix=args.prefix,
        endpoint_url=args.endpoint_url,
        market_name=args.market_name,
        storage_name=args.storage_name,
    )
    print(
        f"saved Spot Market {args.market_name!r} and Spot Checkpoint Storage {args.storage_name!r}"
    )


if __name__ == "__main__":
    main()
