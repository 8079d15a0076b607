"""Staged saves on CPU tensors: no slower than the save before staging existed.

The synthetic state (benchmarks/state.py) saved by ``ucpformat.torch.save`` in one
process, side by side, round robin, median of repeats:

- **unstaged** (``Staging(enabled=False)``): every tensor turned into a numpy view up
  front, as every save did before the staging path existed (the baseline);
- **default**: what a save does now; CPU tensors pass the staging path by (numpy views
  of their own memory), so this must match the baseline;
- **through the pool**: ``Staging(cpu=True)``, every tensor copied into a bounded pool
  of host buffers (a quarter of the state) by the copy thread while the previous one is
  written: what a save from a GPU does, minus the device. Its cost over the baseline is
  the extra memory copy, overlapped with the write.

Saves are not durable (no fsync), so that the disk's noise does not hide the CPU work
being compared.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import Table, common, median, ms, side_by_side
from benchmarks import state as synthetic

SIZE_MIB = 1024
QUICK_SIZE_MIB = 32


def run(quick: bool, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    from ucpformat.torch.staging import HostBufferPool, Staging
    from ucpformat.torch.state import save

    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else SIZE_MIB)
    repeats = repeats if repeats is not None else (3 if quick else 5)
    tensors: dict[str, Any] = synthetic.make(size)
    module = common.buffer_module(tensors)
    nbytes = sum(t.nbytes for t in tensors.values())
    pool = HostBufferPool(max(1, nbytes // 4), pin=False)
    ways = {
        "unstaged (baseline: numpy views, as before staging)": Staging(enabled=False),
        "default (CPU tensors pass staging by)": Staging(pool=pool),
        "through the pool (copied, as from a GPU)": Staging(pool=pool, cpu=True),
    }
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ucp-stg-")))
        directory.mkdir(parents=True, exist_ok=True)

        def case(i: int, staging: Staging) -> Any:
            def fn() -> None:
                save(directory / f"s{i}", model=module, staging=staging, durable=False,
                     overwrite=True)
            return fn

        times = side_by_side({name: case(i, s) for i, (name, s) in enumerate(ways.items())},
                             repeats)
    base = median(next(iter(times.values())))
    rows = [[name, ms(median(t)), f"{median(t) / base:.2f}"] for name, t in times.items()]
    return [Table(
        "Staged save on CPU tensors against the unstaged save (one process)",
        ["save", "ms (median)", "× unstaged"], rows,
        [f"{nbytes / 2**20:,.0f} MiB state, {len(tensors)} tensors; {repeats} repeats, "
         f"round robin; the pool bound {pool.capacity_bytes / 2**20:,.0f} MiB, its peak "
         f"{pool.stats.peak_allocated_bytes / 2**20:,.0f} MiB"],
        data={name: median(t) for name, t in times.items()},
    )]


if __name__ == "__main__":
    for table in run(quick=False):
        print(table.to_markdown())
