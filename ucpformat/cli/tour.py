"""``ucp tour``: a single-process walk-through of the format, in a few seconds.

Builds a small training state with numpy (a tiny MLP in bfloat16 with an fp8 head, Adam
moments and fp32 master weights, step, scheduler, data position, RNG), saves it, inspects
and deep-validates it, reads a slice lazily, loads it back bit-exactly, and shows how a
damaged copy is refused. ``ucp demo`` is the distributed resume-on-a-new-layout demo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

import ucpformat
from ucpformat.checkpoint import rng as generator_states
from ucpformat.checkpoint.metadata import MANIFEST_KEY, ZARR_JSON
from ucpformat.cli import inspect as inspect_cmd
from ucpformat.cli import validate as validate_cmd
from ucpformat.cli.common import ERROR, OK, CommandError, console, human_bytes, manifest_files
from ucpformat.errors import UCPError

STEPS = 7


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "tour",
        parents=[common],
        help="a walk-through: save, inspect, validate, slice, load, refuse damage",
        description="A single-process walk-through of ucpformat on a small training state.",
    )
    p.add_argument("--dir", default=None,
                   help="keep the checkpoints in this directory (default: a temporary one)")
    p.set_defaults(run=run, invalid_status=ERROR)


# -- the training state ------------------------------------------------------------------

VOCAB, DIM, HIDDEN, STEP = 16384, 256, 1024, 1200


def training_state(seed: int = 0) -> dict[str, Any]:
    """A tiny MLP language model mid-training, as numpy arrays and JSON values."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray[Any, Any]:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    master = {
        "embed.weight": normal(VOCAB, DIM),
        "layers.0.weight": normal(HIDDEN, DIM),
        "layers.0.bias": normal(HIDDEN),
        "layers.1.weight": normal(DIM, HIDDEN),
        "layers.1.bias": np.zeros(DIM, np.float32),  # still all zeros: must be stored anyway
    }
    model: dict[str, Any] = {k: v.astype(ml_dtypes.bfloat16) for k, v in master.items()}
    # a frozen, fp8-quantised output head with its scale (not trained: no optimizer state)
    head = normal(VOCAB, DIM, scale=1.0)
    model["head.weight"] = np.clip(head, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    model["head.weight_scale"] = np.float32(0.02)
    state = {
        name: {
            "exp_avg": normal(*w.shape, scale=1e-3),
            "exp_avg_sq": np.abs(normal(*w.shape, scale=1e-6)),
            "master_weight": w,
            "step": np.array(float(STEP), np.float32),
        }
        for name, w in master.items()
    }
    return {
        "model": model,
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [{
                "params": list(master),
                "lr": 2.7e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
            }],
            "state": state,
        },
        "training": {
            "step": STEP,
            "scheduler": {"name": "cosine", "warmup_steps": 100, "max_steps": 10000,
                          "base_lr": 3e-4, "last_epoch": STEP},
            "data": {"epoch": 0, "samples_seen": STEP * 64, "shard": "train-00003"},
            "best_val_loss": float("inf"),
            # the data generator's state, as spec UCP-1.0-R085 lays it out (PCG64: 128-bit integers)
            "rng": generator_states.encode({"generators": {"data": rng.bit_generator.state}}),
        },
    }


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths where two nested states differ (arrays compared bit for bit)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [w for k in a for w in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, np.ndarray | np.generic):
        x, y = np.asarray(a), np.asarray(b)
        same = x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        return [] if same else [where]
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # NaN
        return []
    return [] if a == b else [where]


# -- the walk-through ------------------------------------------------------------------------


class _Narrator:
    def __init__(self, out: Console) -> None:
        self.out = out
        self.step = 0

    def section(self, title: str) -> None:
        self.step += 1
        self.out.print()
        rule = Rule(Text(f"{self.step}/{STEPS}  {title}", "bold"), align="left")
        self.out.print(rule, width=min(self.out.width, 100))

    def say(self, text: str, style: str = "") -> None:
        self.out.print(Text(text, style), soft_wrap=True)

    def command(self, text: str) -> None:
        self.out.print(Text(f"$ {text}", "bold cyan"), soft_wrap=True)


def _prepare(directory: Path, name: str) -> Path:
    """A fresh ``directory/name``, removing only a previous run's checkpoint there."""
    path = directory / name
    if path.exists():
        ours = (path / ZARR_JSON).exists() or (path / MANIFEST_KEY).exists()
        if not ours and any(path.iterdir()):
            raise CommandError(f"{path} exists and is not a checkpoint; not touching it",
                               path=str(path))
        shutil.rmtree(path)
    return path


def walkthrough(directory: Path, out: Console, *, keep: bool = True) -> int:
    n = _Narrator(out)
    t_start = time.perf_counter()
    ckpt_path = _prepare(directory, "demo-checkpoint")
    damaged_path = _prepare(directory, "demo-checkpoint-damaged")

    n.section("Build a training state (numpy only, no torch)")
    state = training_state()
    n.say("A tiny MLP language model at step 1200: bfloat16 weights, an fp8 (float8_e4m3fn) "
          "frozen output head with its scale, AdamW moments and fp32 master weights, the "
          "scheduler, the data position and the RNG state.")

    n.section("Save")
    n.command(f'ucpformat.save({str(ckpt_path)!r}, state, hash_algorithm="sha256", '
              "progress=True)")
    t = time.perf_counter()
    result = ucpformat.save(ckpt_path, state, metadata={"model": "tiny-mlp", "demo": True},
                            hash_algorithm="sha256", progress=sys.stderr.isatty())
    n.say(f"{result.tensors} tensors, {human_bytes(result.nbytes)}, {result.objects} stored "
          f"objects in {time.perf_counter() - t:.2f} s. A CRC32C on every chunk; the manifest "
          "lists every file's size (and, as asked here, its SHA-256). Data first, the root "
          "zarr.json last: that write is the commit.")

    n.section("Inspect (reads the root metadata only)")
    n.command(f"ucp inspect {ckpt_path}")
    with ucpformat.open(ckpt_path) as ckpt:
        inspect_cmd.render(ckpt, manifest_files(ckpt))

    n.section("Validate deeply (every CRC32C and SHA-256)")
    n.command(f"ucp validate --deep {ckpt_path}")
    report = ucpformat.validate(ckpt_path, deep=True, progress=sys.stderr.isatty())
    for issue in report.issues:
        out.print(validate_cmd.issue_line(issue), soft_wrap=True)
    out.print(validate_cmd.verdict(report), soft_wrap=True)
    if not report.valid:
        return 1

    n.section("Read a slice lazily")
    n.command('ckpt["model/embed.weight"][1000:1008]')
    with ucpformat.open(ckpt_path) as ckpt:
        embed = ckpt["model/embed.weight"]
        ckpt.stats.reset()
        rows = embed[1000:1008]
        ok = rows.tobytes() == state["model"]["embed.weight"][1000:1008].tobytes()
        edge = embed.meta.chunk_shape[0]
        touched = 1007 // edge - 1000 // edge + 1
        index = ", plus the shard index" if embed.meta.shard_shape is not None else ""
        n.say(f"8 of {embed.shape[0]} rows ({rows.dtype}, {rows.shape}): read "
              f"{human_bytes(ckpt.stats.bytes_read)} in {ckpt.stats.requests} requests out of "
              f"{human_bytes(embed.nbytes)}: the {touched} inner chunk(s) of {edge} rows that "
              f"overlap{index}. Bit-exact: {'yes' if ok else 'NO'}.")
        if not ok:
            return 1

    n.section("Load everything back and compare bit for bit")
    n.command("ucpformat.open(path).to_dict()")
    with ucpformat.open(ckpt_path) as ckpt:
        loaded = ckpt.to_dict()
    differences = _same(state, loaded)
    if differences:
        n.say(f"MISMATCH at {differences[:5]}", "bold red")
        return 1
    n.say(f"All {result.tensors} tensors are bit-identical (bfloat16 and fp8 included) and "
          "every JSON value round-trips (even best_val_loss = inf).", "green")

    n.section("Damage a copy: it is refused, never read as zeros")
    shutil.copytree(ckpt_path, damaged_path)
    with ucpformat.open(damaged_path) as ckpt:
        weight = ckpt["model/layers.0.weight"].meta
        bias = ckpt["model/layers.1.bias"].meta
    flipped = damaged_path / weight.object_key((0,) * len(weight.shape))
    with open(flipped, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x01]))
    n.say(f"Flip one bit of {flipped.relative_to(damaged_path)}:")
    if not _refused(n, damaged_path, weight.path) or not _validate(n, damaged_path, deep=True):
        return 1
    missing = damaged_path / bias.object_key((0,) * len(bias.shape))
    os.unlink(missing)
    n.say(f"Delete {missing.relative_to(damaged_path)}, the chunk of a bias that is all zeros "
          "(zarr alone would read the missing chunk as fill values, silently):")
    if not _refused(n, damaged_path, bias.path) or not _validate(n, damaged_path, deep=False):
        return 1

    out.print()
    where = (f"The checkpoints are in {directory}." if keep
             else "The checkpoints were temporary (ucp demo --dir DIR keeps them).")
    n.say(f"Done in {time.perf_counter() - t_start:.1f} s. {where}", "bold green")
    return OK


def _refused(n: _Narrator, path: Path, tensor: str) -> bool:
    """Read a damaged tensor; True when the read is refused as it must be."""
    n.command(f'ucpformat.open(...)["{tensor}"].read()')
    with ucpformat.open(path) as ckpt:
        try:
            ckpt[tensor].read()
        except UCPError as exc:
            n.say(f"refused: {type(exc).__name__}: {exc}", "red")
            return True
    n.say("read without error: this must not happen", "bold red")
    return False


def _validate(n: _Narrator, path: Path, *, deep: bool) -> bool:
    """Validate a damaged checkpoint; True when it is found invalid as it must be."""
    n.command(f"ucp validate {'--deep ' if deep else ''}{path}")
    report = ucpformat.validate(path, deep=deep)
    for issue in report.issues:
        n.out.print(validate_cmd.issue_line(issue), soft_wrap=True)
    n.out.print(validate_cmd.verdict(report), soft_wrap=True)
    return not report.valid


def run(args: argparse.Namespace) -> int:
    out = console()
    if args.dir is not None:
        directory = Path(args.dir)
        directory.mkdir(parents=True, exist_ok=True)
        return walkthrough(directory, out)
    with tempfile.TemporaryDirectory(prefix="ucp-demo-") as tmp:
        return walkthrough(Path(tmp), out, keep=False)
