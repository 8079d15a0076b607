"""Peak memory of save and load, each measured in a fresh process.

For every method and operation a new Python process imports what it needs, notes its
resident set (the baseline), then:

* **save**: makes the synthetic state (filled in place: the process then holds exactly
  the state) and saves it; the peak is the most memory the process ever held
  (``VmHWM``) less the baseline, and what the save added is that less the state;
* **load**: loads a checkpoint the method saved before (in another process) and keeps
  the result; the peak less the baseline includes the loaded state.

The target: a save or a load never holds more than the state plus its largest tensor.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 16
METHODS = ("raw", "torch", "safetensors", "dcp", "ucpformat", "ucpformat async")
LOAD_METHODS = ("raw", "torch", "safetensors", "dcp", "ucpformat", "ucpformat staged",
                "ucpformat in_place")
LABELS = {
    "raw": "raw write / read into new arrays",
    "torch": "torch.save / torch.load",
    "safetensors": "safetensors",
    "dcp": "DCP FileSystemWriter / Reader",
    "ucpformat": "ucpformat.torch.save / load_state_dict",
    "ucpformat async": "ucpformat AsyncSaver (staging = a full snapshot)",
    "ucpformat staged": "ucpformat.torch.load(model=), staged (default)",
    "ucpformat in_place": "ucpformat.torch.load(model=, in_place=True)",
}


def child(method: str, op: str, size_mib: float | str, path: str) -> dict[str, Any]:
    """Run in a fresh process: one save or load; memory figures in bytes."""
    size_mib = float(size_mib)
    warnings.filterwarnings("ignore")
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    import ucpformat.torch as ucpt
    from ucpformat.torch.async_save import AsyncSaver

    saver = AsyncSaver() if method == "ucpformat async" else None
    base = common.reset_peak_rss()
    defs = list(synthetic.tensors(size_mib))
    nbytes = sum(d.nbytes for d in defs)
    largest = max(d.nbytes for d in defs)
    if op == "save":
        state: Any = synthetic.make(size_mib)
        held = common.rss_bytes() - base
        if method == "raw":
            common.raw_write(path, state)
        elif method == "torch":
            torch.save(state, path)
        elif method == "safetensors":
            safetensors.torch.save_file(state, path)
        elif method == "dcp":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        elif method == "ucpformat":
            ucpt.save(path, model=common.buffer_module(state))
        elif method == "ucpformat async":
            assert saver is not None
            saver.save(path, model=common.buffer_module(state)).result()
            saver.close()
    else:
        held = 0
        if method == "raw":
            layout = [(d.shape, _np_dtype(d.dtype)) for d in defs]
            result: Any = common.raw_read(path, layout)
        elif method == "torch":
            result = torch.load(path, weights_only=True)
        elif method == "safetensors":
            result = safetensors.torch.load_file(path, backend="pread")
        elif method == "dcp":
            result = {d.name: torch.empty(d.shape, dtype=_torch_dtype(d.dtype)) for d in defs}
            dcp.load(result, storage_reader=dcp.FileSystemReader(path))
        elif method == "ucpformat":
            result = ucpt.load_state_dict(path)
        elif method in ("ucpformat staged", "ucpformat in_place"):
            empty = {d.name: torch.empty(d.shape, dtype=_torch_dtype(d.dtype)) for d in defs}
            result = common.buffer_module(empty)
            ucpt.load(path, model=result, in_place=method == "ucpformat in_place")
        del result
    peak = common.peak_rss_bytes() - base
    return {"peak": peak, "nbytes": nbytes, "largest": largest, "held": held}


def _np_dtype(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float32)


def _torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "bfloat16" else torch.float32


def _spawn(method: str, op: str, size_mib: float, path: str) -> dict[str, Any]:
    return common.run_child("benchmarks.bench_memory:child", method, op, str(size_mib), path)


def measure(size_mib: float, root: Path, methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    out: dict[str, Any] = {"save": {}, "load": {}}
    for method in methods:
        path = str(root / method.replace(" ", "-"))
        out["save"][method] = _spawn(method, "save", size_mib, path)
        for load in [m for m in LOAD_METHODS if m == method or
                     (method == "ucpformat" and m.startswith("ucpformat "))]:
            out["load"][load] = _spawn(load, "load", size_mib, path)
        common.remove(path)
    return out


def tables(m: dict[str, Any], size_mib: float) -> list[Table]:
    mib = 2**20
    any_result = next(iter(m["save"].values()))
    nbytes, largest = any_result["nbytes"], any_result["largest"]
    limit = nbytes + largest
    t = Table(
        title="Peak memory of save and load (fresh process each)",
        columns=["method", "save: peak MiB", "save: added to the state MiB", "save ≤ target",
                 "load: peak MiB", "load ≤ target"],
    )
    rows = [*m["save"], *[k for k in m["load"] if k not in m["save"]]]
    for method in rows:
        s = m["save"].get(method)
        ld = m["load"].get(method)
        t.rows.append([
            LABELS[method],
            "" if s is None else f"{s['peak'] / mib:,.0f}",
            "" if s is None else f"{(s['peak'] - nbytes) / mib:,.0f}",
            "" if s is None else ("yes" if s["peak"] <= limit else "**no**"),
            "" if ld is None else f"{ld['peak'] / mib:,.0f}",
            "" if ld is None else ("yes" if ld["peak"] <= limit else "**no**"),
        ])
    t.notes += [
        f"state {nbytes / mib:,.0f} MiB, largest tensor {largest / mib:,.0f} MiB: target "
        f"peak ≤ {limit / mib:,.0f} MiB (the state + its largest tensor)",
        "peak: the process's peak resident set (VmHWM, reset after imports) less its "
        "resident set after imports; a save's peak includes the "
        "state it saves, a load's the state it loads",
        synthetic.describe(size_mib),
    ]
    t.data = {"nbytes": nbytes, "largest": largest,
              "save": {k: v["peak"] for k, v in m["save"].items()},
              "load": {k: v["peak"] for k, v in m["load"].items()}}
    return [t]


def run(quick: bool = False, *, size_mib: float | None = None,
        directory: Path | None = None) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    methods = ("raw", "ucpformat") if quick else METHODS
    with tempfile.TemporaryDirectory(prefix="ucp-bench-mem-", dir=directory) as tmp:
        return tables(measure(size, Path(tmp), methods), size)
