"""Choosing the inner chunk and shard sizes by measurement.

Inner chunks are the unit of reading (and of checksums); shards, the unit of writing
(one file each). On part of the synthetic state, for each inner chunk size:

* save and (warm) load throughput of ``ucpformat.save`` / a read of every tensor;
* read amplification of resharded loads: the state saved by 4 ranks with tensor
  parallelism 4 (``ucpformat.distributed.save_fragments``, ranks as threads) and read
  by the ranks of other layouts (TP2, TP8, every tensor split along dimension 0 over
  2 and over 8 ranks);

and for each shard size, the files per checkpoint and the save and load throughput.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 8
CHUNK_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
SHARD_SIZES = (16 << 20, 64 << 20, 1 << 30)
SAVE_TP = 4
TARGETS = (("TP2", "tp", 2), ("TP8", "tp", 8), ("dim-0 x2", "dim0", 2),
           ("dim-0 x8", "dim0", 8))


def _numpy_state(size_mib: float) -> tuple[dict[str, Any], dict[str, int | None]]:
    from ucpformat.torch.numpy_bridge import to_numpy

    state: dict[str, Any] = synthetic.make(size_mib)
    dims = {d.name: d.tp_dim for d in synthetic.tensors(size_mib)}
    return {k: to_numpy(v) for k, v in state.items()}, dims


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's split of n into parts: piece i (may be empty)."""
    size = -(-n // parts)
    return min(n, i * size), min(n, (i + 1) * size)


def _box(
    shape: tuple[int, ...], dim: int | None, parts: int, i: int
) -> tuple[tuple[int, int], ...]:
    return tuple(_split(n, parts, i) if d == dim else (0, n) for d, n in enumerate(shape))


def _amplification(arrays: dict[str, Any], dims: dict[str, int | None], chunk_bytes: int,
                   root: Path) -> dict[str, float]:
    from ucpformat import open_checkpoint
    from ucpformat.distributed import Fragment, TensorSpec, read_locals, save_fragments
    from ucpformat.distributed.comm import run_threads
    from ucpformat.format.dtypes import from_numpy
    from ucpformat.layout.boxes import LocalMap, Piece, box_shape, box_size

    path = root / f"amp-{chunk_bytes}"
    specs = [TensorSpec(f"model/{k}", tuple(a.shape), from_numpy(a.dtype).name, {"ucp": {
        "role": "parameter",
        **({"layout": {"tp": {"dim": dims[k]}}} if dims[k] is not None else {}),
    }}) for k, a in arrays.items()]

    def save_rank(comm: Any) -> Any:
        frags = []
        for k, a in arrays.items():
            box = _box(a.shape, dims[k], SAVE_TP, comm.rank)
            if box_size(box):
                frags.append(Fragment(f"model/{k}", box, a[tuple(slice(x, y) for x, y in box)]))
        return save_fragments(path, comm, specs=specs, fragments=frags,
                                chunk_bytes=chunk_bytes, durable=False)

    run_threads(SAVE_TP, save_rank)
    out: dict[str, float] = {}
    for label, kind, ranks in TARGETS:
        needed = read = 0
        for rank in range(ranks):
            with open_checkpoint(path) as ckpt:
                items = []
                for k, a in arrays.items():
                    dim = dims[k] if kind == "tp" else 0
                    box = _box(a.shape, dim, ranks, rank)
                    if not box_size(box):
                        continue
                    local = LocalMap(box_shape(box), (Piece(
                        tuple((0, y - x) for x, y in box), box),))
                    items.append((f"model/{k}", local, None))
                    needed += box_size(box) * a.itemsize
                read_locals(ckpt, items)
                read += ckpt.stats.bytes_read
        out[label] = read / needed
    common.remove(path)
    return out


def measure(size_mib: float, repeats: int, root: Path) -> dict[str, Any]:
    import ucpformat
    from ucpformat.checkpoint.reader import Region

    arrays, dims = _numpy_state(size_mib)
    state = {"model": arrays}
    nbytes = sum(a.nbytes for a in arrays.values())

    def save_load(path: Path, **kw: Any) -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        ucpformat.save(path, state, **kw)
        s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ucpformat.open(path) as ckpt:
            ckpt.read_regions([Region(k, [0] * len(ckpt[k].shape), list(ckpt[k].shape))
                               for k in ckpt])
            chunks = sum(m.object_count * math.prod(m.chunks_per_shard)
                         for m in ckpt.arrays.values())
        ld = time.perf_counter() - t0
        files = len(common.files_under(path))
        common.remove(path)
        return s, ld, files, chunks

    chunk_rows: dict[int, dict[str, Any]] = {}
    shard_rows: dict[int, dict[str, Any]] = {}
    for r in range(repeats):
        for cb in CHUNK_SIZES:
            s, ld, files, chunks = save_load(root / f"chunk-{cb}-{r}", chunk_bytes=cb)
            row = chunk_rows.setdefault(cb, {"save": [], "load": []})
            row["save"].append(s)
            row["load"].append(ld)
            row["chunks"] = chunks
        for sb in SHARD_SIZES:
            s, ld, files, _ = save_load(root / f"shard-{sb}-{r}", shard_bytes=sb)
            row = shard_rows.setdefault(sb, {"save": [], "load": []})
            row["save"].append(s)
            row["load"].append(ld)
            row["files"] = files
    for cb in CHUNK_SIZES:
        chunk_rows[cb]["amplification"] = _amplification(arrays, dims, cb, root)
    return {"size_mib": size_mib, "nbytes": nbytes, "chunks": chunk_rows,
            "shards": shard_rows, "repeats": repeats}


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    gib = m["nbytes"] / 2**30
    c = Table(
        title="Inner chunk size: throughput and resharded read amplification",
        columns=["inner chunk", "chunks", "save GiB/s", "load GiB/s",
                 *[f"amplification {label}" for label, _, _ in TARGETS]],
    )
    for cb, row in m["chunks"].items():
        c.rows.append([
            _size(cb) + (" (default)" if cb == 1 << 20 else ""), f"{row['chunks']:,}",
            f"{gib / med(row['save']):.2f}", f"{gib / med(row['load']):.2f}",
            *[f"{row['amplification'][label]:.3f}" for label, _, _ in TARGETS],
        ])
    c.notes += [
        synthetic.describe(m["size_mib"]),
        f"saved from {SAVE_TP} ranks (threads) with tensor parallelism {SAVE_TP} for the "
        "amplification figures; throughput: one process, durable save, warm load, median "
        f"of {m['repeats']}",
    ]
    s = Table(
        title="Shard size (most bytes one file holds): files and throughput",
        columns=["shard limit", "files", "save GiB/s", "load GiB/s"],
    )
    for sb, row in m["shards"].items():
        s.rows.append([_size(sb) + (" (default)" if sb == 1 << 30 else ""),
                       f"{row['files']:,}", f"{gib / med(row['save']):.2f}",
                       f"{gib / med(row['load']):.2f}"])
    s.notes.append("one zarr.json per tensor and per group besides the shards")
    return [c, s]


def run(quick: bool = False, *, size_mib: float | None = None,
        directory: Path | None = None) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-tune-", dir=directory) as tmp:
        return tables(measure(size, 1 if quick else 2, Path(tmp)))



