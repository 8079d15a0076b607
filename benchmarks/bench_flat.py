"""The safetensors-style API against safetensors itself, on the same tensors.

The bfloat16 weights of the synthetic model (benchmarks/state.py), side by side in one
process, round robin, median of repeats:

- ``save_file`` (durable: ucpformat fsyncs every file; safetensors' file is fsynced after);
- ``load_file`` (safetensors with ``backend="pread"``, which reads the tensors into memory
  as ucpformat does; its default maps the file and reads nothing until touched);
- ``safe_open`` + every name and shape (the metadata only);
- ``safe_open`` + one ``get_slice``: a sixteenth of the rows of the largest tensor.

Reads find the files in the page cache (each was just written or read).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import Table, common, median, ms
from benchmarks import state as synthetic

SIZE_MIB = 2048  # the state whose weights are saved: about 290 MiB of bf16 weights
QUICK_SIZE_MIB = 64


def _weights(d: synthetic.TensorDef) -> bool:
    return d.name.startswith("model.")


def run(quick: bool, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None, durable: bool = True) -> list[Table]:
    """The table; ``durable=False`` (for tests) saves without fsync on both sides."""
    import safetensors
    import safetensors.torch
    import torch

    import ucpformat.torch as ucpt

    warnings.filterwarnings("ignore", category=UserWarning)
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else SIZE_MIB)
    repeats = repeats if repeats is not None else (3 if quick else 7)
    tensors: dict[str, Any] = synthetic.make(size, select=_weights)
    nbytes = sum(t.nbytes for t in tensors.values())
    largest = max(tensors, key=lambda k: tensors[k].nbytes)
    rows = tensors[largest].shape[0]
    lo, hi = rows // 4, rows // 4 + max(1, rows // 16)

    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ucp-flat-")))
        directory.mkdir(parents=True, exist_ok=True)
        st_path, ucp_path = str(directory / "w.safetensors"), directory / "w.ucp"

        def save_st(path: str) -> None:
            safetensors.torch.save_file(tensors, path)
            if durable:
                common.fsync_path(path)

        def save_ucp(path: str) -> None:
            ucpt.save_file(tensors, path, durable=durable)

        saves: dict[str, list[float]] = {"safetensors": [], "ucpformat": []}
        for r in range(repeats + 1):  # the first round warms up
            for name, fn in (("safetensors", save_st), ("ucpformat", save_ucp)):
                target = str(directory / f"save-{name}-{r}")
                t0 = time.perf_counter()
                fn(target)
                if r:
                    saves[name].append(time.perf_counter() - t0)
                common.remove(target)
        save_st(st_path)
        save_ucp(str(ucp_path))

        def st_shapes() -> int:
            with safetensors.safe_open(st_path, framework="pt") as f:
                return len([f.get_slice(k).get_shape() for k in f.keys()])  # noqa: SIM118

        def ucp_shapes() -> int:
            with ucpt.safe_open(ucp_path, framework="pt") as f:
                return len([f.get_slice(k).get_shape() for k in f.keys()])  # noqa: SIM118

        def st_slice() -> Any:
            with safetensors.safe_open(st_path, framework="pt") as f:
                return f.get_slice(largest)[lo:hi]

        def ucp_slice() -> Any:
            with ucpt.safe_open(ucp_path, framework="pt") as f:
                return f.get_slice(largest)[lo:hi]

        assert st_shapes() == ucp_shapes() == len(tensors)
        assert torch.equal(st_slice(), ucp_slice())
        pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
            "`load_file` (every tensor into memory)": (
                lambda: safetensors.torch.load_file(st_path, backend="pread"),
                lambda: ucpt.load_file(ucp_path)),
            "`safe_open` + every name and shape": (st_shapes, ucp_shapes),
            f"`safe_open` + `get_slice(...)[{lo}:{hi}]` of `{largest}`": (st_slice, ucp_slice),
        }
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
        for fns in pairs.values():  # warm-up
            for fn in fns:
                fn()
        for _ in range(repeats):
            for key, fns in pairs.items():
                for side, fn in enumerate(fns):
                    t0 = time.perf_counter()
                    fn()
                    times[key][side].append(time.perf_counter() - t0)
        disk = (os.path.getsize(st_path), common.disk_bytes(ucp_path))

    table = Table(
        title=f"safetensors-style API: {nbytes / 2**20:,.0f} MiB of bf16 weights in "
              f"{len(tensors)} tensors",
        columns=["operation", "safetensors (ms)", "ucpformat (ms)", "× safetensors"],
    )
    save_label = "`save_file` (durable)" if durable else "`save_file` (not durable)"
    rows_out = [(save_label, saves["safetensors"], saves["ucpformat"])]
    rows_out += [(k, a, b) for k, (a, b) in times.items()]
    for label, theirs, ours in rows_out:
        table.rows.append([label, ms(median(theirs)), ms(median(ours)),
                           f"{median(ours) / median(theirs):.2f}"])
    table.notes += [
        f"median of {repeats} round-robin repeats after one warm-up, one process, warm page "
        f"cache; on disk: safetensors {disk[0] / 2**20:,.1f} MiB in one file, ucpformat "
        f"{disk[1] / 2**20:,.1f} MiB (one directory: shards, metadata, manifest)",
        "ucpformat checks a CRC32C of every chunk it reads; safetensors checks nothing",
    ]
    table.data = {"flat": {label: [median(theirs), median(ours)]
                           for label, theirs, ours in rows_out}}
    return [table]
