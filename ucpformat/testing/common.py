"""Shared pieces of the harnesses: test states, bit-exact comparison, figures."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.errors import UCPError
from ucpformat.store import Store

#: Small chunks and shards, so that a small state is many stored objects.
SMALL_CHUNKING: dict[str, Any] = {"chunk_bytes": 1024, "shard_bytes": 4096}


def small_state(seed: int = 0) -> dict[str, Any]:
    """A small training state of several data types, sharded and unsharded tensors."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    w[0, :3] = [np.nan, np.inf, -0.0]  # bit-exactness includes NaN payloads and -0
    return {
        "model": {
            "fc.weight": w,
            "fc.bias": np.zeros(40, np.float32),  # all zeros: still written (UCP-1.0-R030)
            "emb.weight": rng.standard_normal((33, 24)).astype(ml_dtypes.bfloat16),
            "norm.scale": rng.integers(0, 255, size=(7,), dtype=np.uint8),
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [{"params": ["fc.weight", "fc.bias"], "lr": 1e-3 * (seed + 1)}],
            "state": {
                "fc.weight": {
                    "exp_avg": rng.standard_normal((48, 40)).astype(np.float32),
                    "step": np.array(seed, np.float32),
                },
                "fc.bias": {
                    "exp_avg": np.zeros(40, np.float32),
                    "step": np.array(seed, np.float32),
                },
            },
        },
        "training": {
            "step": seed,
            "best_loss": float("inf"),
            "rng": {"torch_cpu": rng.integers(0, 255, size=(64,), dtype=np.uint8)},
        },
    }


def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``, bit for bit for arrays (NaN included)."""
    if isinstance(expected, np.ndarray | np.generic):
        exp = np.asarray(expected)
        if not isinstance(actual, np.ndarray | np.generic):
            return [f"{where}: expected an array, got {type(actual).__name__}"]
        act = np.asarray(actual)
        if act.dtype != exp.dtype or act.shape != exp.shape:
            return [f"{where}: {act.dtype}{act.shape} != {exp.dtype}{exp.shape}"]
        if np.ascontiguousarray(act).tobytes() != np.ascontiguousarray(exp).tobytes():
            return [f"{where}: values differ"]
        return []
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            return [f"{where}: expected a mapping, got {type(actual).__name__}"]
        out = []
        for key in sorted(set(expected) | set(actual), key=str):
            if key not in actual:
                out.append(f"{where}/{key}: missing")
            elif key not in expected:
                out.append(f"{where}/{key}: unexpected")
            else:
                out.extend(differences(actual[key], expected[key], f"{where}/{key}"))
        return out
    if isinstance(expected, float) and isinstance(actual, float):
        same = (math.isnan(expected) and math.isnan(actual)) or expected == actual
        return [] if same else [f"{where}: {actual!r} != {expected!r}"]
    if json.dumps(actual, sort_keys=True, default=str) != json.dumps(
        expected, sort_keys=True, default=str
    ):
        return [f"{where}: {actual!r} != {expected!r}"]
    return []


def load_differences(location: str | os.PathLike[str] | Store, expected: Any) -> list[str] | None:
    """Differences between the checkpoint at ``location`` and ``expected``; None if refused.

    Raises anything that is not a :class:`UCPError` (a bug in the reader).
    """
    try:
        with open_checkpoint(location) as ckpt:
            return differences(ckpt.to_dict(), expected)
    except UCPError:
        return None


def same_state(location: str | os.PathLike[str] | Store, expected: Any) -> bool:
    """True if the checkpoint opens and holds exactly ``expected``, bit for bit."""
    return load_differences(location, expected) == []


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative key -> content)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = Path(dirpath) / name
            out[full.relative_to(root).as_posix()] = full.read_bytes()
    return out


class OutsideWatch:
    """Every access to files outside a checkpoint, as the kernel reports it (inotify):
    a file or directory opened, read, listed, written, created, deleted, moved or changed
    under the watched directories. Linux only (:func:`available`).

    The library opens files relative to directory descriptors, which an audit hook cannot
    place; the kernel's own report does not depend on how a path was resolved. Start
    watching after the files are made, read :meth:`events` before the harness touches
    them itself.
    """

    def __init__(self, *roots: Path) -> None:
        from inotify_simple import INotify, flags

        self._inotify = INotify()
        self._dirs: dict[int, str] = {}
        mask = (flags.ACCESS | flags.MODIFY | flags.ATTRIB | flags.CLOSE_WRITE | flags.OPEN
                | flags.MOVED_FROM | flags.MOVED_TO | flags.CREATE | flags.DELETE
                | flags.DELETE_SELF | flags.MOVE_SELF)
        for root in roots:
            for dirpath, _dirs, _files in os.walk(root):
                self._dirs[self._inotify.add_watch(dirpath, mask)] = dirpath
        self._flags = flags
        self._inotify.read(timeout=0)  # our own walk above: not an access to count

    @staticmethod
    def available() -> bool:
        import importlib.util

        return sys.platform.startswith("linux") and (
            importlib.util.find_spec("inotify_simple") is not None
        )

    def events(self) -> list[str]:
        """What happened since the last call: ``"OPEN|ACCESS outside/secret"`` each."""
        out = []
        for event in self._inotify.read(timeout=0):
            kinds = "|".join(f.name or "?" for f in self._flags.from_mask(event.mask))
            where = os.path.join(self._dirs.get(event.wd, "?"), event.name)
            out.append(f"{kinds} {where}")
        return out

    def close(self) -> None:
        self._inotify.close()

    def __enter__(self) -> OutsideWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_figures(title: str, figures: Mapping[str, Any], *, as_json: bool = False) -> None:
    """Print a harness's figures: one ``name: value`` line each, or one JSON object."""
    if as_json:
        print(json.dumps({"harness": title, **figures}, sort_keys=False))
        return
    print(f"== {title} ==")
    width = max(len(k) for k in figures) if figures else 0
    for key, value in figures.items():
        print(f"{key.ljust(width)} : {value}")
