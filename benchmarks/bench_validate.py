"""Validating a checkpoint of 100,000 arrays (issue 13, item 7: under 60 s on 2 cores).

Two checkpoints of 100,000 tensors of 4 float32: their array documents all alike, and each
different (``attributes.ucp.layout.layer`` is the tensor's index, so no document is
checked once for many). Side by side, in one process, round-robin, median of repeats:

- ``ucpformat.validate`` (shallow: the schemas, the structural rules, the manifest, every
  node's own zarr.json);
- the baseline: read and parse the root zarr.json (what any check must do first);
- jsonschema (Python) on every array document, the schema check ``validate`` ran before
  jsonschema-rs checked first (measured on 1,000 documents, scaled);
- (each different) ``validate(deep=True)``, which also reads every chunk, and
  ``ucp validate`` in a new process (imports included), once each.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import ucpformat
from benchmarks import Table, median, side_by_side
from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.format import schemas

N_ARRAYS = 100_000
QUICK_ARRAYS = 2_000
#: Documents the Python jsonschema baseline checks (then scaled to all of them).
SCHEMA_SAMPLE = 1_000


def make_checkpoint(path: Path, n_arrays: int, *, alike: bool) -> float:
    """Save ``n_arrays`` tensors of 4 float32 (``model/layers.{i}.{j}.weight``); seconds."""
    names = [f"layers.{i // 10}.{i % 10}.weight" for i in range(n_arrays)]
    index = {f"model/{name}": i for i, name in enumerate(names)}

    def attributes(path: str, array: Any) -> dict[str, Any] | None:
        return None if alike else {"ucp": {"role": "parameter",
                                           "layout": {"layer": index[path]}}}

    model = {name: np.full(4, i, np.float32) for i, name in enumerate(names)}
    started = time.perf_counter()
    ucpformat.save(path, {"model": model, "training": {"step": 1}}, durable=False,
                   array_attributes=attributes)
    return time.perf_counter() - started


def validate(path: Path, *, deep: bool = False) -> int:
    report = ucpformat.validate(path, deep=deep)
    assert report.valid, report.errors[:5]
    return len(report.issues)


def parse_root(path: Path) -> int:
    return len(json.loads((path / ZARR_JSON).read_bytes())["consolidated_metadata"]["metadata"])


def array_documents(path: Path) -> list[Any]:
    nodes = json.loads((path / ZARR_JSON).read_bytes())["consolidated_metadata"]["metadata"]
    return [n for n in nodes.values() if n.get("node_type") == "array"]


def jsonschema_sample(documents: list[Any]) -> int:
    """The Python jsonschema check of the first SCHEMA_SAMPLE documents (no fast path)."""
    checker = schemas.validator("array")
    return sum(1 for doc in documents[:SCHEMA_SAMPLE] for _ in checker.iter_errors(doc))


def ucp_validate(path: Path) -> int:
    proc = subprocess.run([sys.executable, "-m", "ucpformat.cli", "validate", "--quiet",
                           str(path)], capture_output=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.returncode


def run(quick: bool, *, n_arrays: int | None = None, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    n = n_arrays if n_arrays is not None else (QUICK_ARRAYS if quick else N_ARRAYS)
    repeats = repeats if repeats is not None else 3
    table = Table(
        title=f"Validate a checkpoint of {n:,} arrays",
        columns=["checkpoint", "method", "median (s)", "min (s)", "µs per array",
                 "× parsing the root"],
    )
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="ucp-bench-validate-")))
        saves = []
        for alike in (True, False):
            what = "documents alike" if alike else "each document different"
            path = directory / ("alike" if alike else "different")
            saves.append(f"{what}: saved in {make_checkpoint(path, n, alike=alike):.0f} s")
            documents = array_documents(path)
            sample = min(SCHEMA_SAMPLE, len(documents))
            schema_case = (f"jsonschema (Python) on every array document (measured on "
                           f"{sample:,}, scaled)")
            cases: dict[str, Callable[[], object]] = {
                "`ucpformat.validate`": lambda p=path: validate(p),
                "read and parse the root zarr.json (baseline)": lambda p=path: parse_root(p),
                schema_case: lambda d=documents: jsonschema_sample(d),
            }
            times = side_by_side(cases, repeats, warmup=0)
            times[schema_case] = [t * len(documents) / sample for t in times[schema_case]]
            if not alike:
                once = side_by_side({
                    "`ucpformat.validate(deep=True)` (once)": lambda p=path: validate(p, deep=True),
                    "`ucp validate` (a new process, once)": lambda p=path: ucp_validate(p),
                }, 1, warmup=0)
                times.update(once)
            base = median(times["read and parse the root zarr.json (baseline)"])
            for name, values in times.items():
                table.rows.append([what, name, f"{median(values):.2f}", f"{min(values):.2f}",
                                   f"{median(values) / n * 1e6:,.0f}",
                                   f"{median(values) / base:.1f}"])
                table.data[f"{what}: {name}"] = median(values)
    table.notes += [
        f"{n:,} tensors of 4 float32 in one group; median of {repeats} round-robin repeats "
        "in one process (deep and the new process: one run each), warm page cache",
        "; ".join(saves) + " (durable=False)",
    ]
    return [table]
