"""Shared fixtures and helpers of the test suite."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.dtypes import DataType


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261121)


@pytest.fixture
def small_state(rng: np.random.Generator) -> dict[str, Any]:
    """A small training state: model, optimizer and training values."""
    import ml_dtypes

    w = rng.standard_normal((96, 40)).astype(np.float32)
    return {
        "model": {
            "fc.weight": w,
            "fc.bias": np.zeros(40, np.float32),
            "emb.weight": rng.standard_normal((33, 8)).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [
                {"params": ["fc.weight", "fc.bias"], "lr": 1e-3, "betas": [0.9, 0.999]}
            ],
            "state": {
                "fc.weight": {"exp_avg": np.ones_like(w), "step": np.array(3.0, np.float32)},
                "fc.bias": {"exp_avg": np.zeros(40, np.float32), "step": np.array(3.0, np.float32)},
            },
        },
        "training": {"step": 3, "best_loss": float("inf")},
    }


@pytest.fixture
def saved(tmp_path: Path, small_state: dict[str, Any]) -> Callable[..., Path]:
    """Save ``small_state`` (or a given state) and return the checkpoint path."""

    def _save(state: dict[str, Any] | None = None, name: str = "ckpt", **kw: Any) -> Path:
        path = tmp_path / name
        kw.setdefault("durable", False)
        ucpformat.save(path, small_state if state is None else state, **kw)
        return path

    return _save


@pytest.fixture
def sharded(saved: Callable[..., Path], rng: np.random.Generator) -> Path:
    """A checkpoint whose ``model/w`` (float32, 13x11) is sharded into several partial shards.

    Inner chunks are 2x2 (some partial at the edges); shards hold several chunks (the
    last ones partial); ``model/b`` is a single unsharded chunk.
    """
    w = rng.standard_normal((13, 11)).astype(np.float32)
    path = saved({"model": {"w": w, "b": np.arange(5, dtype=np.int32)}}, name="sharded",
                 chunk_bytes=16, shard_bytes=160)
    meta = ucpformat.open(path).arrays["model/w"]
    assert meta.shard_shape is not None and meta.chunk_shape == (2, 2)
    assert len(meta.object_grid) == 2 and meta.object_grid[0] > 1
    return path


# -- comparing -----------------------------------------------------------------------


def bits(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """What bit-exact equality compares: dtype, shape and raw bytes (NaN payloads, -0.0)."""
    arr = np.asarray(a)
    return (arr.dtype.str, arr.shape, np.ascontiguousarray(arr).tobytes())


def assert_bits_equal(actual: Any, expected: Any) -> None:
    a, e = bits(actual), bits(expected)
    assert a[:2] == e[:2], f"dtype/shape {a[:2]} != {e[:2]}"
    assert a[2] == e[2], "values differ bit-wise"


def random_array(
    rng: np.random.Generator, dt: DataType, shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    """Random bits of ``dt`` (every NaN payload possible), with -0.0 and infinities mixed in."""
    n = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    arr = raw.view(dt.numpy).reshape(shape).copy()
    if dt.kind in ("float", "complex") and n:
        flat = arr.reshape(-1)
        specials = [-0.0, 0.0, 1.0]
        if dt.has_inf:
            specials += [np.inf, -np.inf]
        with np.errstate(all="ignore"):
            for i, v in zip(rng.integers(0, n, size=min(n, 4)), specials, strict=False):
                if dt.name == "float8_e8m0fnu":
                    continue  # no sign bit, no zero: random bits cover it
                flat[i] = v
    return arr


# -- editing checkpoints on disk -------------------------------------------------------


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def write_json(path: Path, doc: Any) -> None:
    path.write_bytes(json.dumps(doc, indent=2, ensure_ascii=False).encode())


def edit_root(ckpt: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Change the root zarr.json in place (``fn`` mutates the document)."""
    doc = read_json(ckpt / "zarr.json")
    fn(doc)
    write_json(ckpt / "zarr.json", doc)


def node_dir(ckpt: Path, node: str) -> Path:
    return ckpt.joinpath(*node.split("/"))


def edit_node(ckpt: Path, node: str, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Change a node's metadata consistently: its zarr.json, the consolidated copy, the
    manifest entry and the root's manifest reference, so that only ``fn``'s change is wrong."""
    own = node_dir(ckpt, node) / "zarr.json"
    doc = read_json(own)
    fn(doc)
    write_json(own, doc)
    edit_root(ckpt, lambda root: root["consolidated_metadata"]["metadata"].__setitem__(node, doc))
    refresh_manifest(ckpt)


def refresh_manifest(ckpt: Path) -> None:
    """Recompute sizes and hashes of every file the manifest lists, and its root reference."""
    mpath = ckpt / "manifest.ucp.json"
    manifest = read_json(mpath)
    for key, entry in manifest["files"].items():
        data = (ckpt / key).read_bytes()
        entry["nbytes"] = len(data)
        if "sha256" in entry:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    write_json(mpath, manifest)
    body = mpath.read_bytes()
    edit_root(
        ckpt,
        lambda root: root["attributes"]["ucp"]["manifest"].update(
            nbytes=len(body), sha256=hashlib.sha256(body).hexdigest()
        ),
    )


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file (negative offsets count from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes (to prove nothing changed)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
