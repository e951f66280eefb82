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
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter

from prefect_spotgpu.checkpoint import Checkpointer

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
    """Why ``pair`` is dropped (None: kept), its image's SHA-256 and difference hash."""
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
    if digest in sha:
        return "exact_duplicate", digest, 0
    h = dhash(image)
    if hashes:
        known = np.array(hashes, dtype=np.uint64)
        distance = np.unpackbits((known ^ np.uint64(h)).view(np.uint8).reshape(-1, 8), axis=1)
        if int(distance.sum(axis=1).min()) <= NEAR_DUPLICATE_BITS:
            return "near_duplicate", digest, h
    return None, digest, h


def clean(
    ckpt: Checkpointer,
    source: Path,
    out: Path,
    on_notice: Callable[[Checkpointer], None],
    on_shard: Callable[[int, int, dict], None] = lambda done, total, counts: None,
) -> dict:
    """Clean every shard of ``source`` into ``out`` (resuming from ``ckpt``); the report."""
    shards = sorted(source.glob("shard-*.jsonl"))
    out.mkdir(parents=True, exist_ok=True)
    cursor, sha, hashes, counts = 0, set(), [], Counter()
    restored = ckpt.restore()
    if restored is not None:
        state = restored.state
        cursor = int(state["cursor"])
        sha = set(state["sha"])
        hashes = [int(h) for h in state["hashes"]]
        counts = Counter({k: int(v) for k, v in state["counts"].items()})
    for index in range(cursor, len(shards)):
        kept = []
        for line in shards[index].read_text().splitlines():
            pair = json.loads(line)
            counts["seen"] += 1
            reason, digest, h = verdict(pair, sha, hashes)
            if reason is not None:
                counts[reason] += 1
                continue
            sha.add(digest)
            hashes.append(h)
            kept.append(line)
            counts["kept"] += 1
        _write_atomically(out / shards[index].name, "".join(f"{k}\n" for k in kept))
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
    report = {"shards": len(shards), **{k: counts.get(k, 0) for k in ("seen", "kept", *REASONS)}}
    _write_atomically(out / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def make_dataset(directory: Path, pairs: int = 2000, shards: int = 20, seed: int = 0) -> dict:
    """Shards of synthetic photos with planted defects: broken bytes, tiny images, bad
    captions, exact copies and near copies (resized, recompressed, brightened, blurred)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
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
        (directory / f"shard-{s:05d}.jsonl").write_text("".join(f"{c}\n" for c in chunk))
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

    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run, wait_to_be_stopped

    @flow(name="clean-pairs")
    def clean_pairs(source: str, out: str, make_test_set: int = 0) -> dict:
        """Clean the image-caption shards in ``source`` into ``out``; ``make_test_set=N``
        first generates N synthetic pairs in ``source`` (if it is empty)."""
        logger = get_run_logger()
        src = Path(source)
        if make_test_set and not any(src.glob("shard-*.jsonl")):
            logger.info("generated a test set: %s", make_dataset(src, make_test_set))

        def on_shard(done: int, total: int, counts: dict) -> None:
            logger.info("shard %d/%d: kept %d of %d", done, total, counts["kept"], counts["seen"])

        report = clean(checkpointer_for_run(every=60), src, Path(out), wait_to_be_stopped, on_shard)
        create_table_artifact(
            [{"outcome": k, "pairs": v} for k, v in report.items() if k != "shards"],
            key="clean-pairs-report",
            description=f"what happened to the pairs of {report['shards']} shards",
        )
        return report

    return clean_pairs


clean_pairs = _prefect_flow()


if __name__ == "__main__":
    import argparse
    import tempfile

    from prefect_spotgpu.checkpoint import LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped

    parser = argparse.ArgumentParser(description="clean image-caption pairs")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-dataset")
    make.add_argument("directory", type=Path)
    make.add_argument("--pairs", type=int, default=2000)
    run = sub.add_parser("run")
    run.add_argument("source", type=Path)
    run.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "make-dataset":
        print(make_dataset(args.directory, args.pairs))
    else:
        ckpt = Checkpointer(LocalStorage(tempfile.mkdtemp(prefix="clean-")), "clean", every=60)
        print(json.dumps(clean(ckpt, args.source, args.out, wait_to_be_stopped), indent=2))
