"""Optional compression: speed and ratio of each codec of the closed list, per data type.

One layer of the default 2 GiB synthetic state (its bf16 weights and their fp32 master
weights and Adam moments: the shapes of a real layer) is saved by ``ucpformat.save``
(durable) with each compressor, and read back (warm page cache), round-robin; the
stored size of the bf16 and fp32 tensors is given separately (byte-shuffle helps where
the exponent bytes repeat). ``none`` is the default.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 8


def _layer0(d: synthetic.TensorDef) -> bool:
    return ".layers.0." in d.name

#: (label, ucpformat compression argument); blosc shuffles whole elements (its typesize
#: is the item size: 2 bytes for bf16, 4 for fp32).
CODECS: list[tuple[str, Any]] = [
    ("none", None),
    ("zstd level 1", "zstd:1"),
    ("zstd level 3", "zstd:3"),
    ("blosc zstd 3 + byte-shuffle", "blosc:zstd:3:shuffle"),
    ("blosc lz4 5 + byte-shuffle", "blosc:lz4:5:shuffle"),
    ("blosc zstd 3 + bit-shuffle", "blosc:zstd:3:bitshuffle"),
]


def _numpy_state(size_mib: float) -> dict[str, Any]:
    from ucpformat.torch.numpy_bridge import to_numpy

    state: dict[str, Any] = synthetic.make(size_mib, select=_layer0)
    model = {k: to_numpy(v) for k, v in state.items() if k.startswith("model.")}
    optim = {k: to_numpy(v) for k, v in state.items() if k.startswith("optim.")}
    return {"model": model, "optimizer": optim}


def measure(size_mib: float, repeats: int, root: Path) -> dict[str, Any]:
    import ucpformat
    from ucpformat.checkpoint.reader import Region

    state = _numpy_state(size_mib)
    logical = {"bf16": sum(a.nbytes for a in state["model"].values()),
               "fp32": sum(a.nbytes for a in state["optimizer"].values())}
    save_s: dict[str, list[float]] = {label: [] for label, _ in CODECS}
    load_s: dict[str, list[float]] = {label: [] for label, _ in CODECS}
    stored: dict[str, dict[str, int]] = {}
    for r in range(repeats):
        for label, spec in CODECS:
            path = root / f"c{r}-{len(stored)}"
            t0 = time.perf_counter()
            ucpformat.save(path, state, compression=spec)
            save_s[label].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ucpformat.open(path) as ckpt:
                ckpt.read_regions([Region(k, [0] * len(ckpt[k].shape), list(ckpt[k].shape))
                                   for k in ckpt])
            load_s[label].append(time.perf_counter() - t0)
            stored[label] = {"bf16": common.disk_bytes(path / "model"),
                             "fp32": common.disk_bytes(path / "optimizer")}
            common.remove(path)
    return {"size_mib": size_mib, "logical": logical, "save": save_s, "load": load_s,
            "stored": stored, "repeats": repeats}


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    total = sum(m["logical"].values())
    base_save = med(m["save"]["none"])
    base_load = med(m["load"]["none"])
    t = Table(
        title="Optional compression: speed and ratio (stored / logical bytes)",
        columns=["codec", "save MiB/s", "save × none", "load MiB/s", "load × none",
                 "ratio bf16", "ratio fp32"],
    )
    for label, _ in CODECS:
        s, ld = med(m["save"][label]), med(m["load"][label])
        st = m["stored"][label]
        t.rows.append([
            label, f"{total / 2**20 / s:,.0f}", f"{base_save / s:.2f}",
            f"{total / 2**20 / ld:,.0f}", f"{base_load / ld:.2f}",
            f"{st['bf16'] / m['logical']['bf16']:.3f}",
            f"{st['fp32'] / m['logical']['fp32']:.3f}",
        ])
    t.notes += [
        synthetic.describe(m["size_mib"], _layer0) + "; random normal values",
        f"ucpformat.save (durable) and a warm read of every tensor; median of {m['repeats']}",
        "ratios include zarr.json files and shard indexes (they are what the disk holds)",
    ]
    return [t]


def run(quick: bool = False, *, size_mib: float | None = None,
        directory: Path | None = None) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-comp-", dir=directory) as tmp:
        return tables(measure(size, 1 if quick else 3, Path(tmp)))
