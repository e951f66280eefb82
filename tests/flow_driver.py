"""Runs one example flow's work in its own process, as an attempt on a node would.

    python flow_driver.py FLOW CKPT_DIR OUT NOTICE_AT [ARGS_JSON]

FLOW is pretrain, clean or render. With NOTICE_AT >= 0 the notice file appears when that unit
of work (step, shard, frame) is done; the final save follows and the process exits, as the agent
would stop it. Writes what the work returned to OUT/result.json when it completes.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "flows"))

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage

flow, ckpt_dir, out, notice_at = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
args = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
notice = ckpt_dir / "notice.json"
notice.unlink(missing_ok=True)
every = float(os.environ.get("FLOW_DRIVER_EVERY", "1e9"))  # periodic saves, if wanted
ckpt = Checkpointer(LocalStorage(ckpt_dir / "store"), flow, every=every, notice_file=notice)


def at_unit(done: int) -> None:
    if done == notice_at:
        notice.write_text(json.dumps({"deadline": 1e12}))


def stopped(ckpt) -> None:
    print(f"stopped after the final save at {ckpt.last_save.step}")
    sys.exit(0)


if flow == "pretrain":
    from pretrain import GPTConfig, train

    result = train(ckpt, GPTConfig(**args), stopped, lambda step, loss: at_unit(step))
elif flow == "clean":
    from clean import clean

    result = clean(ckpt, Path(args["source"]), out, stopped, lambda d, t, c: at_unit(d - 1))
else:
    from render import render

    from prefect_spotgpu.checkpoint.objects import LocalObjects

    result = render(ckpt, LocalObjects(out), stopped, on_frame=lambda d, t: at_unit(d - 1), **args)
out.mkdir(parents=True, exist_ok=True)
(out / "result.json").write_text(json.dumps(result))
