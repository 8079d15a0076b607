"""Opening a checkpoint of 10,000 small tensors: one metadata read against the alternatives.

Side by side, in one process (warm page cache), median of repeats:

- ``ucpformat.open`` and the shape of every tensor (strict checks of every node included);
- ``ucp inspect --json`` run in-process (open, manifest, JSON document);
- zarr-python's ``open_group(use_consolidated=True)`` and every array's shape;
- the naive baseline: list the directory and parse every array's own ``zarr.json``;
- (full mode) zarr-python without consolidated metadata.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import ucpformat
from benchmarks import Table, median, ms, side_by_side
from ucpformat.checkpoint.metadata import MANIFEST_KEY, ZARR_JSON

N_TENSORS = 10_000
QUICK_TENSORS = 1_000
PER_LAYER = 10


def make_checkpoint(path: Path, n_tensors: int) -> float:
    """Save ``n_tensors`` tensors of 64 float32 (``model/layers.{i}.{j}.weight``); seconds."""
    layers = -(-n_tensors // PER_LAYER)
    model = {
        f"layers.{i}.{j}.weight": np.full(64, i + j / 10, np.float32)
        for i in range(layers)
        for j in range(PER_LAYER)
        if i * PER_LAYER + j < n_tensors
    }
    started = time.perf_counter()
    ucpformat.save(path, {"model": model, "training": {"step": 1}}, durable=False)
    return time.perf_counter() - started


def open_ucpformat(path: Path) -> int:
    with ucpformat.open(path) as ckpt:
        return len([t.shape for t in ckpt.tensors()])


def inspect_json(path: Path) -> int:
    from ucpformat.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["inspect", "--json", str(path)])
    assert code == 0
    return len(buffer.getvalue())


def inspect_process(path: Path) -> int:
    """``ucp inspect --json`` as a user runs it: a new Python process (imports included)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ucpformat.cli", "inspect", "--json",
                           str(path)], capture_output=True, check=True)
    return len(proc.stdout)


def open_cold(path: Path) -> int:
    """``ucpformat.open`` after the root zarr.json was dropped from the page cache."""
    from benchmarks.common import evict

    evict(path / ZARR_JSON)
    return open_ucpformat(path)


def open_zarr(path: Path, *, consolidated: bool) -> int:
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "manifest.ucp.json is not a zarr node"
        group = zarr.open_group(str(path), mode="r", use_consolidated=consolidated)
        return len([n.shape for _, n in group.members(max_depth=None) if isinstance(n, zarr.Array)])


def naive(path: Path) -> int:
    """List the directory, parse every array's own zarr.json."""
    shapes = []
    for dirpath, _, filenames in os.walk(path):
        if ZARR_JSON in filenames and dirpath != str(path):
            with open(os.path.join(dirpath, ZARR_JSON), "rb") as f:
                doc = json.loads(f.read())
            if doc.get("node_type") == "array":
                shapes.append(tuple(doc["shape"]))
    return len(shapes)


def run(quick: bool, *, n_tensors: int | None = None, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    n_tensors = n_tensors if n_tensors is not None else (QUICK_TENSORS if quick else N_TENSORS)
    repeats = repeats if repeats is not None else (3 if quick else 9)
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ucp-bench-")))
        path = directory / "open-10k"
        save_s = make_checkpoint(path, n_tensors)
        cases: dict[str, Any] = {
            "`ucpformat.open` + every shape": lambda: open_ucpformat(path),
            "`ucpformat.open` + every shape, root zarr.json not cached": lambda: open_cold(path),
            "`ucp inspect --json` (in-process)": lambda: inspect_json(path),
            "`ucp inspect --json` (a new process: Python start and imports included)":
                lambda: inspect_process(path),
            "zarr `open_group(use_consolidated=True)` + every shape":
                lambda: open_zarr(path, consolidated=True),
            "naive: list + parse every array's zarr.json": lambda: naive(path),
        }
        if not quick:
            cases["zarr `open_group(use_consolidated=False)` + every shape"] = (
                lambda: open_zarr(path, consolidated=False)
            )
        counts = {name: fn() for name, fn in cases.items()}
        for name, count in counts.items():
            if "inspect" not in name:
                assert count == n_tensors, (name, count)
        times = side_by_side(cases, repeats)
        root_bytes = (path / ZARR_JSON).stat().st_size
        manifest_bytes = (path / MANIFEST_KEY).stat().st_size
    base = median(times["`ucpformat.open` + every shape"])
    table = Table(
        title=f"Open a checkpoint of {n_tensors:,} tensors and list every shape",
        columns=["method", "median (ms)", "min (ms)", "× ucpformat.open"],
    )
    for name, values in times.items():
        ratio = f"{median(values) / base:.2f}"
        table.rows.append([name, ms(median(values)), ms(min(values)), ratio])
    table.notes += [
        f"{n_tensors:,} tensors of 64 float32 (`model/layers.{{i}}.{{j}}.weight`); median of "
        f"{repeats} round-robin repeats after one warm-up, same process, warm page cache",
        f"root zarr.json (consolidated metadata) {root_bytes / 2**20:.1f} MiB, manifest "
        f"{manifest_bytes / 2**20:.1f} MiB; save took {save_s:.1f} s (durable=False)",
    ]
    return [table]
