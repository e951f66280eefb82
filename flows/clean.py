"""Clean image-caption pairs: drop broken, tiny and badly captioned pairs, remove exact and
near-duplicate images, write clean shards and a report.

Input: a directory of shards ``shard-00000.jsonl`` ... , one pair per line
(``{"id", "caption", "image": base64 bytes}``). For each input shard, one output shard of the
pairs kept, written atomically (temporary file, fsync, rename), plus ``report.json``.

Across preemptions **no pair is lost or written twice**: the checkpoint holds the shard cursor,
the dedup index (SHA-256 of every kept image, and its 64-bit difference hash) and the counts,
and it is saved only after the shard's output is durable. A resumed run redoes at most the
shard it was on, from the index as it was before that shard, so it writes the same bytes again
over the same file.

    python flows/clean.py make-dataset DIR [--pairs 2000]   # a realistic test set
    python flows/clean.py run DIR OUT                       # clean it without Prefect's server
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter

from prefect_spotgpu.checkpoint import Checkpointer
from prefect_spotgpu.checkpoint.objects import LocalObjects, ObjectStore

MIN_SIDE = 32  # pixels
MIN_WORDS, MAX_CHARS = 3, 300
NEAR_DUPLICATE_BITS = 10  # of 64: difference hashes this close are the same picture
REASONS = ("undecodable", "too_small", "empty_caption", "short_caption", "long_caption")
REASONS += ("exact_duplicate", "near_duplicate")


# ---------------------------------------------------------------- the cleaning


def dhash(image: Image.Image) -> int:
    """64-bit difference hash: brightness gradients of a 9x8 grey thumbnail."""
    small = np.asarray(image.convert("L").resize((9, 8), Image.Resampling.LANCZOS), dtype=np.int16)
    bits = (small[:, 1:] > small[:, :-1]).flatten()
    return int(np.packbits(bits).view(">u8")[0])


def verdict(pair: dict, sha: set[str], hashes: list[int]) -> tuple[str | None, str, int]:
    """Why ``pair`` is dropped (None: kept), its image's SHA-256 and difference hash, given
    the images kept before it (``sha``, ``hashes``): :func:`signature` then :func:`dedup`."""
    return dedup(*signature(pair), sha, hashes)


def signature(pair: dict) -> tuple[str | None, str, int]:
    """What a pair's own content says, whatever else is in the set: why it is dropped on its
    own (None: it may be kept), its image's SHA-256 and difference hash. The costly part
    (decoding, hashing): a fan-out computes it shard by shard on many spot runs."""
    caption = (pair.get("caption") or "").strip()
    try:
        raw = base64.b64decode(pair["image"], validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception:
        return "undecodable", "", 0
    digest = hashlib.sha256(raw).hexdigest()
    if min(image.size) < MIN_SIDE:
        return "too_small", digest, 0
    if not caption:
        return "empty_caption", digest, 0
    if len(caption.split()) < MIN_WORDS:
        return "short_caption", digest, 0
    if len(caption) > MAX_CHARS:
        return "long_caption", digest, 0
    return None, digest, dhash(image)


def dedup(
    reason: str | None, digest: str, h: int, sha: set[str], hashes: list[int]
) -> tuple[str | None, str, int]:
    """A pair's verdict from its :func:`signature`, against the images kept before it in
    the set's order: an exact copy (same SHA-256) or a near copy (difference hashes at most
    ``NEAR_DUPLICATE_BITS`` apart) of a kept image is dropped. Cheap, and in order: how the
    set was split never changes a decision."""
    if reason is not None:
        return reason, digest, h
    if digest in sha:
        return "exact_duplicate", digest, 0
    if hashes:
        known = np.array(hashes, dtype=np.uint64)
        distance = np.unpackbits((known ^ np.uint64(h)).view(np.uint8).reshape(-1, 8), axis=1)
        if int(distance.sum(axis=1).min()) <= NEAR_DUPLICATE_BITS:
            return "near_duplicate", digest, h
    return None, digest, h


def clean(
    ckpt: Checkpointer,
    source: ObjectStore | Path,
    out: ObjectStore | Path,
    on_notice: Callable[[Checkpointer], None],
    on_shard: Callable[[int, int, dict], None] = lambda done, total, counts: None,
    source_prefix: str = "",
    out_prefix: str = "",
) -> dict:
    """Clean every shard of ``source`` (``<source_prefix>/shard-*.jsonl``) into ``out`` (the
    run's storage: ``<out_prefix>/``), resuming from ``ckpt``; the report."""
    source, out = as_store(source), as_store(out)
    shards = shard_names(source, source_prefix)
    cursor, sha, hashes, counts = 0, set(), [], Counter()
    restored = ckpt.restore()
    if restored is not None:
        state = restored.state
        cursor = int(state["cursor"])
        sha = set(state["sha"])
        hashes = [int(h) for h in state["hashes"]]
        counts = Counter({k: int(v) for k, v in state["counts"].items()})
    for index in range(cursor, len(shards)):
        lines = source.get(shards[index]).decode().splitlines()
        sigs = [signature(json.loads(line)) for line in lines]
        kept = sift(lines, sigs, sha, hashes, counts)
        out.put(join(out_prefix, base(shards[index])), "".join(f"{k}\n" for k in kept).encode())
        state = {
            "cursor": index + 1,
            "sha": sorted(sha),
            "hashes": np.array(hashes, dtype=np.uint64),
            "counts": dict(counts),
        }
        on_shard(index + 1, len(shards), dict(counts))
        ckpt.maybe_save(state, index)  # after the shard is durable: never ahead of the output
        if ckpt.notice_received:
            on_notice(ckpt)
    return write_report(out, out_prefix, len(shards), counts)


def sift(
    lines: list[str], sigs: list, sha: set[str], hashes: list[int], counts: Counter
) -> list[str]:
    """The lines of one shard that are kept, given their :func:`signature` s, in order, each
    against the images kept before it (``sha``, ``hashes``: extended here); ``counts`` gets
    every pair's outcome."""
    kept = []
    for line, (reason, digest, h) in zip(lines, sigs, strict=True):
        counts["seen"] += 1
        reason, digest, h = dedup(reason, digest, int(h), sha, hashes)
        if reason is not None:
            counts[reason] += 1
            continue
        sha.add(digest)
        hashes.append(h)
        kept.append(line)
        counts["kept"] += 1
    return kept


def write_report(out: ObjectStore, prefix: str, shards: int, counts: Counter) -> dict:
    report = {"shards": shards, **{k: counts.get(k, 0) for k in ("seen", "kept", *REASONS)}}
    out.put(join(prefix, "report.json"), (json.dumps(report, indent=2) + "\n").encode())
    return report


# ---------------------------------------------------------------- split over many runs


def shard_signatures(
    ckpt: Checkpointer,
    source: ObjectStore,
    names: list[str],
    out: ObjectStore,
    out_prefix: str,
    on_notice: Callable[[Checkpointer], None],
    pace_seconds: float = 0.0,
) -> list[str]:
    """One child of a cleaning fan-out: each input shard's :func:`signature` list, stored
    **once** as ``<out_prefix>/signatures/<shard>.json`` (one that is there already, from an
    earlier attempt on any host, is not computed again). The names stored.
    ``pace_seconds``: a shard takes at least this long (a GPU's time, in tests)."""
    stored = []
    for index, name in enumerate(names):
        target = join(out_prefix, f"signatures/{base(name)}.json")
        if not out.exists(target):
            log_work(target)
            began = time.monotonic()
            lines = source.get(name).decode().splitlines()
            sigs = [signature(json.loads(line)) for line in lines]
            time.sleep(max(0.0, pace_seconds - (time.monotonic() - began)))
            out.put_new(target, json.dumps(sigs).encode())
        stored.append(target)
        ckpt.maybe_save({"next": np.array([index + 1])}, index)  # acknowledges a notice
        if ckpt.notice_received:
            on_notice(ckpt)
    return stored


def signatures_once(store_url: str, name: str, out_prefix: str, pace_seconds: float = 0.0) -> str:
    """One input shard's signatures as a Dask task on a spot worker (``clean_on_dask``):
    computed and stored once (``put_once``) as ``<out_prefix>/signatures/<shard>.json``."""
    from prefect_spotgpu.checkpoint.objects import objects_from_url
    from prefect_spotgpu.dask import put_once

    store = objects_from_url(store_url)
    target = join(out_prefix, f"signatures/{base(name)}.json")

    def compute() -> bytes:
        log_work(target)
        began = time.monotonic()
        sigs = [signature(json.loads(line)) for line in store.get(name).decode().splitlines()]
        time.sleep(max(0.0, pace_seconds - (time.monotonic() - began)))
        return json.dumps(sigs).encode()

    put_once(store, target, compute)
    return target


def clean_on_dask(store_url: str, source: str, out: str, *, cluster: dict, workers: int = 16,
                  pace_seconds: float = 0.0) -> dict:  # fmt: skip
    """Cleaning for many short shards: each input shard's signatures a Dask task on a
    ``SpotGPUCluster`` (``cluster``: its keyword arguments) of at most ``workers`` spot
    workers, under prefect-dask's ``DaskTaskRunner``; then the decisions in the set's order
    here (``decide_and_write``): the report and the clean shards are an uninterrupted
    ``clean``'s, byte for byte, however the tasks were spread or recomputed."""
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    from prefect_spotgpu.checkpoint.objects import objects_from_url

    shard = task(name="clean-signatures", retries=2)(signatures_once)
    runner = DaskTaskRunner(
        cluster_class="prefect_spotgpu.dask.SpotGPUCluster",
        cluster_kwargs=cluster,
        adapt_kwargs={"minimum": 1, "maximum": workers},
    )

    @flow(name="clean-on-dask", task_runner=runner)
    def cleaning() -> dict:
        store = objects_from_url(store_url)
        src, dst = join("outputs", source), join("outputs", out)
        names = shard_names(store, src)
        shard.map(store_url, names, dst, pace_seconds).result()
        return decide_and_write(store, names, store, dst)

    return cleaning()


def decide_and_write(
    source: ObjectStore, names: list[str], out: ObjectStore, out_prefix: str
) -> dict:
    """The parent of a cleaning fan-out, once every shard's signatures are stored: the dedup
    decisions in the set's order (:func:`dedup`: the same as one uninterrupted run's), the
    clean shards and the report, written into ``out``; the report."""
    sha: set[str] = set()
    hashes: list[int] = []
    counts: Counter = Counter()
    for name in names:
        sigs = json.loads(out.get(join(out_prefix, f"signatures/{base(name)}.json")))
        lines = source.get(name).decode().splitlines()
        if len(sigs) != len(lines):
            raise ValueError(f"signatures of {name} do not match its {len(lines)} pairs")
        kept = sift(lines, sigs, sha, hashes, counts)
        out.put(join(out_prefix, base(name)), "".join(f"{k}\n" for k in kept).encode())
    return write_report(out, out_prefix, len(names), counts)


def log_work(name: str) -> None:
    """A unit of work begun, in ``$FLOWS_WORK_LOG`` when it is set (``render.log_work``)."""
    path = os.environ.get("FLOWS_WORK_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{name}\n")


def shard_names(store: ObjectStore, prefix: str) -> list[str]:
    return [n for n in store.names(prefix) if base(n).startswith("shard-") and n.endswith(".jsonl")]


def as_store(place: ObjectStore | Path) -> ObjectStore:
    """A local directory as named objects (the command line and the tests); a store as is."""
    return LocalObjects(place) if isinstance(place, (str, Path)) else place


def base(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def join(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


# ---------------------------------------------------------------- a realistic test set

WORDS = [
    "a red bicycle leaning on a brick wall",
    "two dogs running across a beach at sunset",
    "a bowl of ramen with a soft egg",
    "snow on the roofs of an old town",
    "a child flying a kite in a park",
    "a lighthouse under a stormy sky",
    "fresh bread on a wooden table",
    "a cat asleep on a stack of books",
    "city lights reflected in a river at night",
]


def make_dataset(
    directory: ObjectStore | Path, pairs: int = 2000, shards: int = 20, seed: int = 0, prefix=""
) -> dict:
    """Shards of synthetic photos with planted defects: broken bytes, tiny images, bad
    captions, exact copies and near copies (resized, recompressed, brightened, blurred),
    written as ``<prefix>/shard-NNNNN.jsonl`` into ``directory`` (a store, or a local path)."""
    rng = random.Random(seed)
    store = as_store(directory)
    originals: list[bytes] = []
    planted = Counter()
    lines: list[str] = []
    for i in range(pairs):
        kind = rng.choices(
            ["good", "undecodable", "too_small", "caption", "exact", "near"],
            weights=[70, 3, 3, 8, 8, 8],
        )[0]
        caption = f"{rng.choice(WORDS)}, photo {i}"
        if kind in ("exact", "near") and originals:
            source = rng.choice(originals)
            raw = source if kind == "exact" else _near_copy(source, rng)
        elif kind == "undecodable":
            raw = _picture(rng)[: rng.randint(10, 200)] + b"\x00garbage"
        elif kind == "too_small":
            raw = _picture(rng, size=(rng.randint(8, 24), rng.randint(8, 24)))
        else:
            raw = _picture(rng)
            if kind == "good":
                originals.append(raw)
        if kind == "caption":
            caption = rng.choice(["", "   ", "a cat", "a very long and rambling caption " * 12])
        planted[kind] += 1
        image = base64.b64encode(raw).decode()
        lines.append(json.dumps({"id": i, "caption": caption, "image": image}))
    per_shard = -(-pairs // shards)
    for s in range(shards):
        chunk = lines[s * per_shard : (s + 1) * per_shard]
        store.put(join(prefix, f"shard-{s:05d}.jsonl"), "".join(f"{c}\n" for c in chunk).encode())
    return dict(planted)


def _picture(rng: random.Random, size: tuple[int, int] | None = None) -> bytes:
    w, h = size or (rng.randint(64, 160), rng.randint(64, 160))
    image = Image.new("RGB", (w, h), tuple(rng.randint(0, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 8)):
        box = sorted(rng.sample(range(w), 2)), sorted(rng.sample(range(h), 2))
        shape = (box[0][0], box[1][0], box[0][1], box[1][1])
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(shape, fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="JPEG" if rng.random() < 0.5 else "PNG", quality=90)
    return buf.getvalue()


def _near_copy(raw: bytes, rng: random.Random) -> bytes:
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    edit = rng.choice(["resize", "recompress", "brighten", "blur"])
    if edit == "resize":
        image = image.resize((int(image.width * 0.8), int(image.height * 0.8)))
    elif edit == "brighten":
        image = ImageEnhance.Brightness(image).enhance(1.1)
    elif edit == "blur":
        image = image.filter(ImageFilter.GaussianBlur(1))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=rng.randint(60, 85))
    return buf.getvalue()


# ---------------------------------------------------------------- the Prefect flow


def _prefect_flow():
    from prefect import flow, get_run_logger
    from prefect.artifacts import create_table_artifact

    from prefect_spotgpu.checkpoint.flow import (
        checkpointer_for_run,
        run_outputs,
        wait_to_be_stopped,
    )

    @flow(name="clean-pairs")
    def clean_pairs(source: str, out: str, make_test_set: int = 0) -> dict:
        """Clean the image-caption shards ``outputs/<source>/`` of the run's storage into
        ``outputs/<out>/`` (durable, seen from every host); ``make_test_set=N`` first
        generates N synthetic pairs in ``source`` (if it has no shards)."""
        logger = get_run_logger()
        store, src = run_outputs(source)
        _, dst = run_outputs(out)
        if make_test_set and not shard_names(store, src):
            logger.info("generated a test set: %s", make_dataset(store, make_test_set, prefix=src))

        def on_shard(done: int, total: int, counts: dict) -> None:
            logger.info("shard %d/%d: kept %d of %d", done, total, counts["kept"], counts["seen"])

        ckpt = checkpointer_for_run(every=60)
        report = clean(ckpt, store, store, wait_to_be_stopped, on_shard, src, dst)
        create_table_artifact(
            [{"outcome": k, "pairs": v} for k, v in report.items() if k != "shards"],
            key="clean-pairs-report",
            description=f"what happened to the pairs of {report['shards']} shards",
        )
        return report

    @flow(name="clean-signatures")
    def clean_signatures(names: list[str], out: str, pace_seconds: float = 0.0) -> list[str]:
        """One child of a cleaning fan-out (``clean_fanout``): the signatures of the input
        shards ``names`` (objects of the run's storage) into ``outputs/<out>/signatures/``,
        each once."""
        store, dst = run_outputs(out)
        ckpt = checkpointer_for_run(every=0.001)
        return shard_signatures(ckpt, store, names, store, dst, wait_to_be_stopped, pace_seconds)

    return clean_pairs, clean_signatures


clean_pairs, clean_signatures = _prefect_flow()


if __name__ == "__main__":
    import argparse
    import tempfile

    from _cli import add_flow_parameters  # flows/_cli.py: the flow's parameters as arguments

    from prefect_spotgpu.checkpoint import LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped

    parser = argparse.ArgumentParser(
        description="Clean image-caption pairs here, without Prefect's server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-dataset", help="write a realistic test set into DIRECTORY")
    make.add_argument("directory", type=Path)
    make.add_argument("--pairs", type=int, default=2000)
    run = sub.add_parser(
        "run",
        help="clean the shards of the directory SOURCE into the directory OUT",
        description="Clean the shards of the directory SOURCE into the directory OUT (with "
        "--make-test-set N, first N synthetic pairs into SOURCE if it has no shards).",
    )
    add_flow_parameters(run, __file__, "clean_pairs")
    args = parser.parse_args()
    if args.command == "make-dataset":
        print(make_dataset(args.directory, args.pairs))
    else:
        source, out = Path(args.source), Path(args.out)
        if args.make_test_set and not shard_names(as_store(source), ""):
            print(make_dataset(source, args.make_test_set))
        ckpt = Checkpointer(LocalStorage(tempfile.mkdtemp(prefix="clean-")), "clean", every=60)
        print(json.dumps(clean(ckpt, source, out, wait_to_be_stopped), indent=2))
