"""The safetensors-style API against safetensors itself, on the same tensors.

The bfloat16 weights of the synthetic model (benchmarks/state.py), side by side in one
process, round robin, median of repeats:

- ``save_file`` (durable: ucpformat fsyncs every file; safetensors' file is fsynced after);
- ``load_file`` (safetensors with ``backend="pread"``, which reads the tensors into memory
  as ucpformat does; its default maps the file and reads nothing until touched);
- ``safe_open`` + every name and shape (the metadata only);
- ``safe_open`` + one ``get_slice``: a sixteenth of the rows of the largest tensor.

Reads find the files in the page cache (each was just written or read).

A second table (issue 28) loads and touches every value, as a new user would, at 1 MiB,
64 MiB, 512 MiB and 2 GiB of mixed types (the synthetic state's bf16 weights and fp32
master weights and Adam moments; the 1 MiB set is the first tensors of the smallest
state): ``load_file`` (safetensors' default, which maps the file) and ``safe_open`` +
``get_tensor`` of every name, each followed by a sum over every byte of every tensor
(the touch, one torch thread: a mapped file is read only then). Warm page cache, round
robin, median.
"""

from __future__ import annotations

import contextlib
import functools
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
#: Sizes of the load-and-touch table (MiB), full and quick runs.
LADDER_MIB = (1, 64, 512, 2048)
QUICK_LADDER_MIB = (1, 16)


def _weights(d: synthetic.TensorDef) -> bool:
    return d.name.startswith("model.")


def mixed(size_mib: float) -> dict[str, Any]:
    """About ``size_mib`` MiB of the synthetic state's tensors (bf16 and fp32), in order."""
    state = synthetic.make(max(size_mib, 4))
    out: dict[str, Any] = {}
    total = 0
    for name, tensor in state.items():
        if total >= size_mib * 2**20:
            break
        out[name] = tensor
        total += tensor.nbytes
    return out


def touch(tensors: dict[str, Any]) -> int:
    """Read every byte of every tensor (a mapped file is read only when touched)."""
    import torch

    return sum(int(torch.sum(t.reshape(-1).view(torch.uint8), dtype=torch.int64))
               for t in tensors.values())


def chunk_ranges(path: Path) -> list[tuple[int, int]]:
    """Where each chunk's values lie in the one-file checkpoint at ``path``: (start,
    bytes before its CRC32C), from the central directory and each local header."""
    import zipfile

    from ucpformat.engine.checksum import CRC_BYTES

    ranges = []
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            if "/c/" in info.filename or info.filename.endswith("/c"):
                f.seek(info.header_offset + 26)  # the local header's name and extra lengths
                lengths = f.read(4)
                start = info.header_offset + 30 + int.from_bytes(lengths[:2], "little") \
                    + int.from_bytes(lengths[2:], "little")
                ranges.append((start, info.file_size - CRC_BYTES))
    return ranges


def checks_alone(path: Path, chunks: list[tuple[int, int]]) -> dict[str, float]:
    """The checks a reader of the one-file checkpoint at ``path`` cannot skip, each timed
    on its own with the library's functions (seconds): the archive's central directory
    read and checked (UCP-1.0-R075, R077, R091), the root parsed as strict JSON (R009)
    and its digest compared (R058), and every chunk's CRC32C (``chunks``:
    :func:`chunk_ranges`) computed over a fresh copy-on-write mapping of the file, as
    the load maps it (R041)."""
    import mmap
    import zipfile

    from ucpformat.checkpoint.metadata import ZARR_JSON, check_root_digest, loads
    from ucpformat.engine.checksum import crc32c
    from ucpformat.store import zip_layout
    from ucpformat.store.posix import pread_all

    with zipfile.ZipFile(path) as archive:  # (not timed)
        root = archive.read(ZARR_JSON)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
        zip_layout.read_directory(lambda at, n: pread_all(fd, n, at), size, where=str(path),
                                  limit=1 << 30)
        t1 = time.perf_counter()
        check_root_digest(root, loads(root, what=ZARR_JSON), where=str(path))
        t2 = time.perf_counter()
        mapped = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mapped)
        for start, n in chunks:
            if crc32c(view[start:start + n]).to_bytes(4, "little") != view[start + n:
                                                                          start + n + 4]:
                raise AssertionError(f"chunk at {start}: its CRC32C differs")
        t3 = time.perf_counter()
        view.release()
        mapped.close()
    finally:
        os.close(fd)
    return {"directory": t1 - t0, "root": t2 - t1, "crc32c": t3 - t2, "checks": t3 - t0}


def ladder(sizes: tuple[float, ...], repeats: int, directory: Path) -> list[Table]:
    """Load and touch every value, safetensors against ucpformat, at each size; then the
    loads alone beside the checks alone (:func:`checks_alone`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the touch's sums: OpenMP threads swing with the machine's load
    try:
        return _ladder(sizes, repeats, directory)
    finally:
        torch.set_num_threads(threads)


def _ladder(sizes: tuple[float, ...], repeats: int, directory: Path) -> list[Table]:
    import safetensors
    import safetensors.torch

    import ucpformat.torch as ucpt

    floor = Table(
        title="The loads alone (no touch) beside the checks alone: where the one-file "
              "load's time goes",
        columns=["size", "tensors", "st load_file ms", "ucpz load_file ms", "× st",
                 "directory ms", "root ms", "CRC32C ms", "checks ms", "checks / st"],
    )

    table = Table(
        title="Load and touch every value: safetensors against the flat API, as a directory "
              "and as one file",
        columns=["size", "tensors", "files (st / ucp dir / ucpz)", "st load_file ms",
                 "dir ms", "× st", "ucpz ms", "× st", "st safe_open ms", "dir ms", "× st",
                 "ucpz ms", "× st"],
    )
    data: dict[str, Any] = {}
    for size in sizes:
        tensors = mixed(size)
        nbytes = sum(t.nbytes for t in tensors.values())
        st_path, ucp_path = str(directory / f"l{size}.safetensors"), directory / f"l{size}.ucp"
        one_path = directory / f"l{size}.ucpz"
        safetensors.torch.save_file(tensors, st_path)
        ucpt.save_file(tensors, ucp_path, durable=False)
        ucpt.save_file(tensors, one_path, durable=False)
        del tensors

        def st_each(path: str = st_path) -> int:
            with safetensors.safe_open(path, framework="pt") as f:
                return touch({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118

        def ucp_each(path: Path) -> int:
            with ucpt.safe_open(path, framework="pt") as f:
                return touch({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118

        def st_load(path: str = st_path) -> int:
            return touch(safetensors.torch.load_file(path))

        def ucp_load(path: Path) -> int:
            return touch(ucpt.load_file(path))

        cases: dict[str, Any] = {
            "st load": st_load, "ucp load": functools.partial(ucp_load, ucp_path),
            "ucpz load": functools.partial(ucp_load, one_path), "st open": st_each,
            "ucp open": functools.partial(ucp_each, ucp_path),
            "ucpz open": functools.partial(ucp_each, one_path)}
        assert len({fn() for fn in cases.values()}) == 1  # the same bytes, and a warm-up
        untouched: dict[str, Any] = {
            "st only": lambda path=st_path: len(safetensors.torch.load_file(path)),
            "ucpz only": lambda path=one_path: len(ucpt.load_file(path)),
            "checks": functools.partial(checks_alone, one_path, chunk_ranges(one_path))}
        times: dict[str, list[float]] = {k: [] for k in [*cases, *untouched]}
        parts: dict[str, list[float]] = {}
        for r in range(repeats):
            names = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
            for name in [*names, *untouched]:
                fn = cases.get(name) or untouched[name]
                t0 = time.perf_counter()
                result = fn()
                times[name].append(time.perf_counter() - t0)
                if name == "checks":
                    times[name][-1] = result["checks"]
                    for part, seconds in result.items():
                        parts.setdefault(part, []).append(seconds)
        files = len(common.files_under(ucp_path))
        med = {k: median(v) for k, v in times.items()}
        count = len(ucpt.safe_open(ucp_path).keys())
        table.rows.append([
            f"{nbytes / 2**20:,.1f} MiB", str(count), f"1 / {files:,} / 1",
            *(cell for op in ("load", "open") for cell in (
                [ms(med[f"st {op}"])] + [x for form in ("ucp", "ucpz") for x in (
                    ms(med[f"{form} {op}"]), f"{med[f'st {op}'] / med[f'{form} {op}']:.2f}")])),
        ])
        floor.rows.append([
            f"{nbytes / 2**20:,.1f} MiB", str(count), ms(med["st only"]), ms(med["ucpz only"]),
            f"{med['st only'] / med['ucpz only']:.2f}",
            *(ms(median(parts[p])) for p in ("directory", "root", "crc32c")),
            ms(med["checks"]), f"{med['checks'] / med['st only']:.2f}"])
        data[str(size)] = {**med, "files": files, "nbytes": nbytes,
                           "checks": {p: median(v) for p, v in parts.items()}}
        common.remove(st_path)
        common.remove(ucp_path)
        common.remove(one_path)
    table.notes += [
        f"median of {repeats} round-robin repeats after a warm-up, one process, warm page "
        "cache; '× st' is a throughput ratio (safetensors' time over ucpformat's: above 1 "
        "is faster); safetensors' `load_file` maps the file (its default), the touch reads it",
        "ucpformat checks a CRC32C of every chunk before handing out its values; "
        "safetensors checks nothing; 'ucpz' is the same checkpoint in one file (spec §11.5)",
        f"load average (1/5/15 min) at the end: {common.load_average()}",
    ]
    table.data = {"flat_ladder": data}
    floor.notes += [
        "the same files and repeats as the table above; `load_file` here returns the "
        "tensors untouched (safetensors' maps the file and reads no value)",
        "the checks alone, each with the library's own functions: the archive's central "
        "directory read and checked (directory), the root parsed as strict JSON and its "
        "digest compared (root), and every chunk's CRC32C over a fresh copy-on-write "
        "mapping of the file (CRC32C, which also faults in the pages the touch would); "
        "'checks / st' is their sum over safetensors' whole `load_file`: above 1, no "
        "reader that checks what the spec requires can load as fast as safetensors, which "
        "checks nothing",
    ]
    return [table, floor]


def run(quick: bool, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None, durable: bool = True,
        ladder_mib: tuple[float, ...] | None = None) -> list[Table]:
    """The tables; ``durable=False`` (for tests) saves without fsync on both sides."""
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
    sizes = ladder_mib if ladder_mib is not None else (QUICK_LADDER_MIB if quick else LADDER_MIB)
    if not sizes:
        return [table]
    with tempfile.TemporaryDirectory(prefix="ucp-flat-ladder-") as tmp:
        return [table, *ladder(sizes, repeats, Path(tmp))]
