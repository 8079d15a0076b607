"""Save and load throughput against the peers and the hardware limit, one process.

The synthetic state of :mod:`benchmarks.state` (default 2 GiB) is saved and loaded, in
one process, by every method, round-robin (each repetition runs every method once, in a
rotating order, so that drift hits all alike), and the medians are compared:

* **the limit**: every tensor's bytes written back to back into one file with ``write``
  and one ``fsync``; read back with ``preadv`` into newly allocated arrays that are kept
  (as a loader keeps them: their pages are faulted in exactly as a loader's are);
* ``torch.save`` (+ ``fsync``) / ``torch.load``; safetensors ``save_file`` (+ ``fsync``) /
  ``load_file(backend="pread")`` (its default maps the file and reads nothing yet);
  PyTorch DCP ``FileSystemWriter`` / ``FileSystemReader`` (defaults; its load fills a
  state dict of new, untouched tensors, as it needs one);
* ucpformat: ``ucpformat.torch.save(model=...)`` (durable) and
  ``ucpformat.torch.load_state_dict`` (new tensors), ``ucpformat.torch.load(model=...)``
  into a model whose tensors are zeroed (as its constructor leaves them), both staged
  (the default: read into staging, checked, then handed to the model's tensors) and with
  ``in_place=True`` (read straight into the model's tensors), and ``AsyncSaver.save``.
  Loads repeated in one process find memory the allocator kept from the load before:
  ``bench_resume`` times each load in a fresh process, as a resume runs.

Every save writes a new directory and is durable before it returns (fsync). Loads are
measured twice: **cold**, after the checkpoint's pages were dropped from the page cache
(``posix_fadvise(DONTNEED)`` on its files: no root needed, nobody else's cache touched),
and **warm**, right after (page cache hot: the CPU cost of a loader). The async save is
also compared with a plain copy of the state (``copy_`` into preallocated tensors).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 16

SAVERS = ("raw", "torch", "safetensors", "dcp", "ucpformat", "ucpformat async")
LOADERS = ("raw", "torch", "safetensors", "dcp", "ucpformat", "ucpformat staged",
           "ucpformat in_place")
#: The loads measured on the checkpoint each save wrote.
LOADS_OF = {
    "raw": ("raw",),
    "torch": ("torch",),
    "safetensors": ("safetensors",),
    "dcp": ("dcp",),
    "ucpformat": ("ucpformat", "ucpformat staged", "ucpformat in_place"),
    "ucpformat async": (),
}
LABELS = {
    "raw": "**limit**: raw write+fsync / read into new arrays",
    "torch": "torch.save + fsync / torch.load",
    "safetensors": "safetensors save_file + fsync / load_file",
    "dcp": "DCP FileSystemWriter / FileSystemReader",
    "ucpformat": "ucpformat.torch.save / load_state_dict",
    "ucpformat async": "ucpformat AsyncSaver.save (call to commit)",
    "ucpformat staged": "ucpformat.torch.load(model=), staged (default)",
    "ucpformat in_place": "ucpformat.torch.load(model=, in_place=True)",
}


def _quiet() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def measure(size_mib: float, repeats: int, root: Path) -> dict[str, Any]:
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    import ucpformat.torch as ucpt
    from ucpformat.torch.async_save import AsyncSaver

    _quiet()
    state = synthetic.make(size_mib)
    module = common.buffer_module(state)
    layout = common.numpy_layout(state)
    nbytes = sum(t.nbytes for t in state.values())  # type: ignore[attr-defined]
    largest = max(t.nbytes for t in state.values())  # type: ignore[attr-defined]
    saver = AsyncSaver()
    staging_copy = common.empty_like_state(state)

    def target(method: str, r: int) -> str:
        return str(root / f"{method.replace(' ', '-')}-{r}")

    def save(method: str, path: str) -> float:
        """Seconds until the checkpoint is durable (for async: until committed)."""
        t0 = time.perf_counter()
        if method == "raw":
            common.raw_write(path, state)
        elif method == "torch":
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        elif method == "safetensors":
            safetensors.torch.save_file(state, path)
            common.fsync_path(path)
        elif method == "dcp":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        elif method == "ucpformat":
            ucpt.save(path, model=module)
        elif method == "ucpformat async":
            saver.wait()
            t0 = time.perf_counter()
            future = saver.save(path, model=module)
            blocked.append(time.perf_counter() - t0)
            future.result()
        return time.perf_counter() - t0

    def loader(method: str, path: str) -> Callable[[], Any]:
        if method == "raw":
            return lambda: common.raw_read(path, layout)
        if method == "torch":
            return lambda: torch.load(path, weights_only=True)
        if method == "safetensors":
            # the default backend maps the file (lazy: nothing is read until touched);
            # "pread" reads the tensors into memory, as every other loader here does
            return lambda: safetensors.torch.load_file(path, backend="pread")
        if method == "dcp":
            # the model's own state dict, as a training script passes it: memory in use
            fresh = common.empty_like_state(state, touched=True)
            return lambda: dcp.load(fresh, storage_reader=dcp.FileSystemReader(path)) or fresh
        if method == "ucpformat":
            return lambda: ucpt.load_state_dict(path)
        if method in ("ucpformat staged", "ucpformat in_place"):
            # a model as its constructor leaves it (its memory in use), not untouched
            # memory, whose first-touch page faults the load would pay (BENCHMARKS.md)
            into = common.buffer_module(state, empty=True, touched=True)
            direct = method == "ucpformat in_place"

            def into_model() -> Any:
                ucpt.load(path, model=into, in_place=direct)
                return into

            return into_model
        raise ValueError(method)

    saves: dict[str, list[float]] = {m: [] for m in SAVERS}
    cold: dict[str, list[float]] = {m: [] for m in LOADERS}
    warm: dict[str, list[float]] = {m: [] for m in LOADERS}
    blocked: list[float] = []
    copies: list[float] = []
    clones: list[float] = []
    files: dict[str, int] = {}
    sizes: dict[str, int] = {}

    def timed(fn: Callable[[], Any]) -> float:
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - t0
        del result
        return elapsed

    for r in range(repeats + 1):  # repetition 0 warms up (first touch of memory, caches)
        order = SAVERS[r % len(SAVERS):] + SAVERS[: r % len(SAVERS)]
        for method in order:
            path = target(method, r)
            seconds = save(method, path)
            if r:
                saves[method].append(seconds)
            files[method] = len(common.files_under(path))
            sizes[method] = common.disk_bytes(path)
            for m in LOADS_OF[method]:
                fn = loader(m, path)
                common.evict(path)
                c = timed(fn)
                w = timed(fn)
                if r:
                    cold[m].append(c)
                    warm[m].append(w)
            common.remove(path)
        # plain copies of the state, for the async save's blocked time
        c = timed(lambda: [staging_copy[k].copy_(v) for k, v in state.items()])
        k = timed(lambda: [v.clone() for v in state.values()])
        if r:
            copies.append(c)
            clones.append(k)
    saver.close()
    first_blocked = blocked[0]
    return {
        "size_mib": size_mib,
        "nbytes": nbytes,
        "largest": largest,
        "tensors": len(state),
        "description": synthetic.describe(size_mib),
        "repeats": repeats,
        "save": saves,
        "cold": cold,
        "warm": warm,
        "blocked_first": first_blocked,
        "blocked": blocked[1:],
        "copy": copies,
        "clone": clones,
        "files": files,
        "disk_bytes": sizes,
        "load_average": common.load_average(),
    }


def _gib_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 2**30 / seconds:.2f}"


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    nbytes = m["nbytes"]
    raw_save = med(m["save"]["raw"])
    raw_cold = med(m["cold"]["raw"])
    raw_warm = med(m["warm"]["raw"])
    dcp_save = med(m["save"]["dcp"])
    dcp_cold = med(m["cold"]["dcp"])
    dcp_warm = med(m["warm"]["dcp"])
    t = Table(
        title=f"Save and load, one process: {nbytes / 2**30:.2f} GiB state",
        columns=["method", "save s", "save GiB/s", "save × limit", "save × DCP",
                 "load cold s", "cold × limit", "cold × DCP", "load warm s",
                 "warm × limit", "warm × DCP", "files"],
    )
    rows: dict[str, dict[str, float]] = {}
    for method in ("raw", "torch", "safetensors", "dcp", "ucpformat", "ucpformat async",
                   "ucpformat staged", "ucpformat in_place"):
        row: list[str] = [LABELS[method]]
        data: dict[str, float] = {}
        if method in m["save"]:
            s = med(m["save"][method])
            data["save_s"] = s
            row += [f"{s:.2f}", _gib_s(nbytes, s), f"{raw_save / s:.2f}", f"{dcp_save / s:.2f}"]
        else:
            row += ["", "", "", ""]
        if method in m["cold"]:
            c, w = med(m["cold"][method]), med(m["warm"][method])
            data["cold_s"], data["warm_s"] = c, w
            row += [f"{c:.2f}", f"{raw_cold / c:.2f}", f"{dcp_cold / c:.2f}",
                    f"{w:.2f}", f"{raw_warm / w:.2f}", f"{dcp_warm / w:.2f}"]
        else:
            row += [""] * 6
        files = m["files"].get(method)
        row.append("" if files is None else f"{files:,}")
        rows[method] = data
        t.rows.append(row)
    t.notes += [
        m["description"],
        f"median of {m['repeats']} round-robin repetitions after one warm-up; "
        "'× limit' and '× DCP' are throughput ratios (time of the limit or DCP / time of "
        "the method: above 1 is faster)",
        "cold: the checkpoint's pages dropped from the page cache before the load; warm: "
        "the same load again right after",
        f"load average (1/5/15 min) at the end: {m['load_average']}",
    ]
    staged_cost = {
        kind: med(m[kind]["ucpformat staged"]) / med(m[kind]["ucpformat in_place"])
        for kind in ("cold", "warm")
    }
    t.notes.append(
        "a load into a model, staged (the default: a failed load changes nothing) over "
        f"in_place=True (no staging): {staged_cost['cold']:.2f}x the time cold, "
        f"{staged_cost['warm']:.2f}x warm"
    )
    default = {kind: med(m[kind]["ucpformat staged"]) for kind in ("cold", "warm")}
    t.notes.append(
        "the default load into a model (`ucpformat.torch.load(model=)`, staged) as a "
        "throughput ratio over `load_state_dict` (new tensors): "
        f"{med(m['cold']['ucpformat']) / default['cold']:.2f} cold, "
        f"{med(m['warm']['ucpformat']) / default['warm']:.2f} warm; over DCP's load: "
        f"{dcp_cold / default['cold']:.2f} cold, {dcp_warm / default['warm']:.2f} warm; over "
        f"`torch.load`: {med(m['cold']['torch']) / default['cold']:.2f} cold, "
        f"{med(m['warm']['torch']) / default['warm']:.2f} warm"
    )
    copy = med(m["copy"])
    clone = med(m["clone"])
    blocked = med(m["blocked"]) if m["blocked"] else m["blocked_first"]
    a = Table(
        title="Async save: time the caller is blocked vs a plain copy of the state",
        columns=["measure", "seconds", "× plain copy"],
        rows=[
            ["plain copy: `copy_` of every tensor into preallocated tensors",
             f"{copy:.3f}", "1.00"],
            ["`clone()` of every tensor (allocates)", f"{clone:.3f}", f"{clone / copy:.2f}"],
            ["`AsyncSaver.save` blocked, first save (allocates its staging buffers)",
             f"{m['blocked_first']:.3f}", f"{m['blocked_first'] / copy:.2f}"],
            ["`AsyncSaver.save` blocked, later saves", f"{blocked:.3f}",
             f"{blocked / copy:.2f}"],
            ["`AsyncSaver.save` call to commit", f"{med(m['save']['ucpformat async']):.3f}",
             f"{med(m['save']['ucpformat async']) / copy:.2f}"],
        ],
        notes=[f"the same {nbytes / 2**30:.2f} GiB state, one process (no torch.distributed)"],
    )
    t.data = {"rows": rows, "nbytes": nbytes, "blocked_over_copy": blocked / copy,
              "staged_over_in_place": staged_cost}
    return [t, a]


def run(quick: bool = False, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    reps = repeats if repeats is not None else (1 if quick else 7)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-tp-", dir=directory) as tmp:
        return tables(measure(size, reps, Path(tmp)))
