"""The bundle execution step of a spot-gpu pool (``prefect_spotgpu.bundles``): the job a
decorated flow's bid carries, run by the node's Python:

    python -m prefect_spotgpu.bundles.execute --url URL --key KEY

Like every spot job (``prefect_spotgpu.launch``) it first waits for the worker's go, so the
worker stays the one writer of the run's state between attempts. Then it reads ``bundles/KEY``
from the storage at ``URL`` (credentials from the job's environment), checks its SHA-256
against the label the caller set (``spotgpu.bundle-sha256``), and runs the flow in this
process, as ``python -m prefect.engine`` would run a deployment's: the notice's SIGUSR1 reaches
the flow's checkpointer, and SIGTERM ends it as the engine's own handler says. Each attempt of
the run (after a preemption, on another node) reads the same bundle again.

A bundle that cannot be read, or whose bytes are not the ones the caller uploaded, is never
run: the flow run is set Failed with a message saying which, and the job exits 0 (the run is
over). A flow that raises is Failed by the engine, as with a deployment. A gang member of rank
above 0 runs the flow's function from the bundle (``launch.run_flow_function``).

The engine runs as ``python -m prefect.engine`` would run it, through
``prefect_spotgpu.prefect_internals.run_engine`` (the one module that reaches Prefect's private
internals).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from uuid import UUID

from prefect_spotgpu import launch
from prefect_spotgpu.bundles import bundle_name
from prefect_spotgpu.prefect_internals import run_engine
from prefect_spotgpu.protocol import JOB_ENV, LABELS, TORCH_ENV


class BundleRefused(Exception):
    """The bundle cannot be run: the message says why (the flow run's Failed message)."""


def read_bundle(url: str, key: str, expected_sha256: str | None) -> dict:
    """The bundle ``key`` from the job's own storage (``SPOTGPU_CHECKPOINT_URL``: in a
    container, the tenant's directory as mounted there) or else from ``url`` (the pool's
    storage as the caller wrote it), once its bytes match ``expected_sha256``."""
    from prefect_spotgpu.checkpoint.objects import objects_from_url

    name = bundle_name(key)
    places = list(dict.fromkeys(u for u in (os.environ.get(JOB_ENV.CHECKPOINT_URL), url) if u))
    errors = []
    for place in places:
        try:
            data = objects_from_url(place).get(name)
            break
        except Exception as exc:
            errors.append(f"{place}: {type(exc).__name__}: {exc}")
    else:
        raise BundleRefused(
            f"the flow's bundle {name} could not be read ({'; '.join(errors)}): for local "
            "storage the pool's directory must be one every node reaches at that path; "
            "S3 storage reaches every node"
        )
    if expected_sha256 is None:
        raise BundleRefused(
            f"the flow run has no {LABELS.BUNDLE_SHA256} label: its bundle {name} was not "
            "uploaded by prefect_spotgpu.bundles.upload, and is not run"
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise BundleRefused(
            f"the flow's bundle {name} at {url} is not the one its caller uploaded "
            f"(SHA-256 {actual[:16]}..., recorded {expected_sha256[:16]}...): it was changed "
            "in storage, and is not run"
        )
    try:
        return json.loads(data)
    except ValueError as exc:
        raise BundleRefused(f"the flow's bundle {name} is not a Prefect bundle: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the run's storage: a path or s3://")
    parser.add_argument("--key", required=True, help="the bundle's key")
    args = parser.parse_args(argv)
    code = launch.wait_for_go()
    if code is not None:
        return code
    flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])

    from prefect.bundles import extract_flow_from_bundle
    from prefect.client.orchestration import get_client
    from prefect.states import Failed

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        try:
            bundle = read_bundle(
                args.url, args.key, (flow_run.labels or {}).get(LABELS.BUNDLE_SHA256)
            )
            flow = extract_flow_from_bundle(bundle)
        except Exception as exc:
            message = str(exc) if isinstance(exc, BundleRefused) else (
                f"the flow's bundle {bundle_name(args.key)} could not be loaded: "
                f"{type(exc).__name__}: {exc}"
            )  # fmt: skip
            print(f"spotgpu: {message}", file=sys.stderr)
            client.set_flow_run_state(flow_run_id, Failed(message=message), force=True)
            return 0
    if os.environ.get(TORCH_ENV.RANK, "0") != "0":  # a gang member of rank > 0
        code = launch.run_flow_function(str(flow_run_id), load=lambda: (flow, flow_run.parameters))
        return code or launch.until_the_run_ends(str(flow_run_id))
    sys.stdout.flush()
    return run_engine(flow, str(flow_run_id))


if __name__ == "__main__":
    sys.exit(main())
