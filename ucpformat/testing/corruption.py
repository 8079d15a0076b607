"""Corruption, measured: valid checkpoints damaged at random, and every damage detected.

Each trial takes a fresh copy of a valid checkpoint (one of several: uncompressed, zstd,
gzip and blosc, with and without SHA-256 digests in the manifest) and damages one file:

- *targets*: the data of a stored object (``chunk``), the index at the end of a shard
  (``shard-index``), the ``zarr.json`` of a node (``node-metadata``), the root
  ``zarr.json`` (``root-metadata``), the manifest (``manifest``);
- *damages*: flip one bit, overwrite one byte with another, zero a run of 1 to 64 bytes,
  truncate to a shorter length, delete the file.

A damage that changes nothing (zeroing zeros, or bytes of a JSON document that leave an
equal document) is drawn again. Then the checkpoint is opened, every tensor read and
compared with what was saved, and ``validate(deep=True)`` run. The damage is *detected*
if ``open`` or a read raises a ``UCPError`` or validation reports an error; it is *named*
if an error names the damaged tensor and stored object (data) or the damaged file
(metadata). Any other exception is a crash. Figures: damages tried, detected, named,
reads that returned wrong values without an error (which validation must then catch).

Run ``python -m ucpformat.testing.corruption --trials 1000`` (``make stress``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucpformat.checkpoint.metadata import MANIFEST_KEY, ZARR_JSON
from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.checkpoint.validation import validate
from ucpformat.checkpoint.writer import save
from ucpformat.engine.shard_index import index_nbytes
from ucpformat.errors import UCPError
from ucpformat.format.jsonvalues import json_equal
from ucpformat.testing.common import (
    SMALL_CHUNKING,
    differences,
    print_figures,
    small_state,
    tree_bytes,
)

TARGETS = ("chunk", "shard-index", "node-metadata", "root-metadata", "manifest")
DAMAGES = ("bitflip", "byte", "zero", "truncate", "delete")
VARIANTS: tuple[dict[str, Any], ...] = (
    {"compression": None, "hash_algorithm": None},
    {"compression": "zstd", "hash_algorithm": "sha256"},
    {"compression": "gzip", "hash_algorithm": None},
    {"compression": "blosc", "hash_algorithm": "sha256"},
    {"compression": None, "hash_algorithm": "sha256"},
)


@dataclass
class Base:
    """A valid checkpoint kept in memory: its files, and what each file is."""

    files: dict[str, bytes]
    expected: Any
    kinds: dict[str, str]  # key -> "object" | "node" | "root" | "manifest"
    tensor_of: dict[str, str]  # object key -> tensor path
    index_bytes: dict[str, int]  # object key -> size of its shard index (0: unsharded)


def make_base(directory: Path, seed: int, variant: dict[str, Any]) -> Base:
    state = small_state(seed)
    save(directory, state, durable=False, **variant, **SMALL_CHUNKING)
    files = tree_bytes(directory)
    kinds: dict[str, str] = {}
    tensor_of: dict[str, str] = {}
    index_bytes: dict[str, int] = {}
    with open_checkpoint(directory) as ckpt:
        for path, meta in ckpt.arrays.items():
            for key in files:
                if key == f"{path}/c" or key.startswith(f"{path}/c/"):
                    tensor_of[key] = path
                    index_bytes[key] = (
                        0 if meta.shard_shape is None else index_nbytes(meta.chunks_per_shard)
                    )
    for key in files:
        if key == ZARR_JSON:
            kinds[key] = "root"
        elif key == MANIFEST_KEY:
            kinds[key] = "manifest"
        elif key in tensor_of:
            kinds[key] = "object"
        else:
            kinds[key] = "node"
    return Base(files, state, kinds, tensor_of, index_bytes)


@dataclass
class Damage:
    target: str
    kind: str
    key: str
    detail: str = ""
    detected_by: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    named: bool = False
    silent_wrong_read: bool = False
    crash: str = ""


def _candidates(base: Base, target: str) -> list[tuple[str, int, int]]:
    """(key, start, stop) byte ranges that ``target`` damages may touch."""
    out = []
    for key, data in base.files.items():
        kind = base.kinds[key]
        if target == "chunk" and kind == "object":
            out.append((key, 0, len(data) - base.index_bytes[key]))
        elif target == "shard-index" and kind == "object" and base.index_bytes[key]:
            out.append((key, len(data) - base.index_bytes[key], len(data)))
        elif (target, kind) in (
            ("node-metadata", "node"), ("root-metadata", "root"), ("manifest", "manifest")
        ):
            out.append((key, 0, len(data)))
    return out


def _is_json_noop(key: str, before: bytes, after: bytes | None) -> bool:
    """True if a JSON document's damage leaves an equal document (not a damage at all)."""
    if after is None or not key.endswith(".json"):
        return False
    try:
        return json_equal(json.loads(before), json.loads(after))
    except ValueError:
        return False


def draw_damage(
    base: Base, target: str, kind: str, rng: random.Random
) -> tuple[Damage, bytes | None]:
    """A damage and the damaged file's new content (None: deleted)."""
    for _ in range(1000):
        key, lo, hi = rng.choice(_candidates(base, target))
        data = bytearray(base.files[key])
        if kind == "delete":
            return Damage(target, kind, key, "deleted"), None
        if kind == "truncate":
            cut = rng.randrange(0, len(data))
            if target == "shard-index":
                cut = rng.randrange(max(0, lo), len(data))
            return Damage(target, kind, key, f"truncated to {cut} of {len(data)} bytes"), bytes(
                data[:cut]
            )
        if hi <= lo:
            continue
        pos = rng.randrange(lo, hi)
        if kind == "bitflip":
            bit = rng.randrange(8)
            data[pos] ^= 1 << bit
            detail = f"bit {bit} of byte {pos} flipped"
        elif kind == "byte":
            data[pos] = (data[pos] + rng.randrange(1, 256)) % 256
            detail = f"byte {pos} replaced"
        else:
            n = rng.randint(1, min(64, hi - pos))
            data[pos : pos + n] = bytes(n)
            detail = f"{n} bytes zeroed at {pos}"
        after = bytes(data)
        if after == base.files[key] or _is_json_noop(key, base.files[key], after):
            continue  # no damage at all: draw again
        return Damage(target, kind, key, detail), after
    raise RuntimeError(f"no effective {kind} damage of {target} found")


def _names(damage: Damage, base: Base, text: str) -> bool:
    if damage.target in ("chunk", "shard-index"):
        tensor = base.tensor_of[damage.key]
        return tensor in text and damage.key[len(tensor) + 1 :] in text
    if damage.target == "node-metadata":
        return damage.key.rsplit("/", 1)[0] in text
    if damage.target == "root-metadata":
        return ZARR_JSON in text or "root" in text or "/" in text
    return MANIFEST_KEY in text


def check(directory: Path, damage: Damage, base: Base) -> None:
    """Open, read everything, validate deeply: record what detected the damage."""
    texts: list[str] = []
    try:
        try:
            with open_checkpoint(directory) as ckpt:
                try:
                    diffs = differences(ckpt.to_dict(), base.expected)
                    if diffs:
                        damage.silent_wrong_read = True
                except UCPError as exc:
                    damage.detected_by.append("read")
                    texts.append(f"{exc.tensor or ''} {exc}")
        except UCPError as exc:
            damage.detected_by.append("open")
            texts.append(f"{exc.tensor or ''} {exc}")
        report = validate(directory, deep=True)
        if report.errors:
            damage.detected_by.append("validate")
            texts.extend(f"{i.path} {i.message} {i.rule}" for i in report.errors)
    except Exception:
        damage.crash = traceback.format_exc(limit=4)
    damage.messages = texts[:3]
    damage.named = any(_names(damage, base, t) for t in texts)


@dataclass
class Figures:
    tried: int = 0
    detected: int = 0
    named: int = 0
    silent_wrong_reads: int = 0
    crashes: int = 0
    by_cell: Counter[str] = field(default_factory=Counter)
    detected_by: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, d: Damage) -> None:
        self.tried += 1
        self.by_cell[f"{d.target}/{d.kind}"] += 1
        if d.crash:
            self.crashes += 1
            self.failures.append(f"CRASH {d.target}/{d.kind} {d.key} ({d.detail}): {d.crash}")
        if d.detected_by:
            self.detected += 1
            self.detected_by[d.detected_by[0]] += 1
        elif not d.crash:
            self.failures.append(f"UNDETECTED {d.target}/{d.kind} {d.key} ({d.detail})")
        if d.named:
            self.named += 1
        elif d.detected_by:
            self.failures.append(
                f"NOT NAMED {d.target}/{d.kind} {d.key} ({d.detail}): {d.messages[:2]}"
            )
        self.silent_wrong_reads += d.silent_wrong_read

    def as_dict(self) -> dict[str, Any]:
        return {
            "damages tried": self.tried,
            "detected": self.detected,
            "undetected": self.tried - self.detected - self.crashes,
            "named (tensor and stored object, or file)": self.named,
            "crashes (exceptions other than UCPError)": self.crashes,
            "reads that returned wrong values without an error": self.silent_wrong_reads,
            "first detected by": dict(sorted(self.detected_by.items())),
            "damages per target/kind": dict(sorted(self.by_cell.items())),
        }


def run(trials: int, *, seed: int = 0, workdir: Path | None = None,
        progress: bool = False) -> Figures:
    rng = random.Random(seed)
    figures = Figures()
    cells = [(t, k) for t in TARGETS for k in DAMAGES]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        bases = [make_base(root / f"base{i}", seed + i, v) for i, v in enumerate(VARIANTS)]
        for i in range(trials):
            target, kind = cells[i % len(cells)]
            b = (i // len(cells)) % len(bases)
            base, directory = bases[b], root / f"base{b}"
            damage, content = draw_damage(base, target, kind, rng)
            path = directory / damage.key
            if content is None:
                path.unlink()
            else:
                path.write_bytes(content)
            try:
                check(directory, damage, base)
            finally:  # undo the damage: the next trial starts from the valid checkpoint
                path.write_bytes(base.files[damage.key])
            figures.add(damage)
            if progress and (i + 1) % 100 == 0:
                print(f"  {i + 1}/{trials} damages, {figures.tried - figures.detected} "
                      "undetected", flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.corruption",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.trials, seed=args.seed, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("corruption (ucpformat.testing.corruption)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    ok = figures.detected == figures.tried and figures.named == figures.tried
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
