"""Reading checkpoints: one metadata read to open, then any slice of any tensor on demand.

``open`` reads only the root ``zarr.json`` (consolidated metadata) and checks it. A slice
reads only the stored objects and inner chunks that overlap it, through the array engine
(:mod:`ucpformat.engine.read`): a chunk that must exist and does not is an error, never
fill values; every chunk and shard index is CRC-checked and a failure names the tensor
and the chunk. This module holds the API: opening, selections, limits, batching.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.checkpoint.metadata import (
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    check_root_digest,
    check_root_digest_member,
    check_values,
    gc_paused,
    loads,
    parse_array,
    parse_group,
    parse_version,
)
from ucpformat.engine.grid import objects_overlapping
from ucpformat.engine.memory import new_array
from ucpformat.engine.read import ArrayReader, ChunkRead, group_runs
from ucpformat.errors import (
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    ResourceLimitError,
    SelectionError,
    TensorNotFoundError,
    UCPError,
    UnsafePathError,
    UnsupportedFeatureError,
)
from ucpformat.format import jsonvalues, names
from ucpformat.format.schemas import DATE_TIME
from ucpformat.store import Store, read_guarded

#: Largest metadata document (root zarr.json, manifest, node zarr.json) read by default;
#: a larger one is refused before it is read (UCP-1.0-R098). The root of 100,000 tensors
#: is about 40 MiB.
MAX_METADATA_BYTES = 256 << 20
#: Peak memory of parsing a metadata document, in bytes per byte of it, at most: CPython's
#: json reaches 37 on the worst structures (nested one-element lists), 10 on real roots
#: (docs/reliability.md). The default limit keeps a parse within ``max_read_bytes``.
METADATA_MEMORY_FACTOR = 48
#: The default limit is never below this (a small max_read_bytes still opens small roots).
MIN_METADATA_BYTES = 64 << 10
#: Features a 1.x reader understands (``attributes.ucp.must_understand``).
UNDERSTOOD_FEATURES: frozenset[str] = frozenset()


@functools.cache
def physical_memory() -> int:
    """The memory this process can have: the physical memory, or less where an address
    space limit (RLIMIT_AS) or a cgroup's memory.max says so. Found once per process:
    every open asked, and reading the cgroup's file twice cost more than opening a
    checkpoint of a few tensors."""
    try:
        memory = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        memory = 1 << 40
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            memory = min(memory, int(soft))
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            memory = min(memory, int(text))
    except OSError:
        pass
    return memory


@dataclass
class ReadStats:
    """Bytes and requests a checkpoint has read so far (for read-amplification figures)."""

    bytes_read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, nbytes: int) -> None:
        """One request of ``nbytes`` (from any thread)."""
        with self._lock:
            self.bytes_read += nbytes
            self.requests += 1

    def reset(self) -> None:
        self.bytes_read = 0
        self.requests = 0


class Checkpoint:
    """An open checkpoint: metadata in memory, tensors read lazily."""

    #: Inner chunks that lie back to back in a shard are read with one request of up to
    #: this many bytes (then checked one by one); runs are read in parallel.
    RUN_BYTES = 16 << 20
    #: A batch of reads of at most this many bytes in all is read by the calling thread
    #: alone: starting the pool's threads cost more than such reads (a fifth of a 1 MiB
    #: load of 19 tensors).
    SERIAL_BYTES = 4 << 20
    #: An item of a batch (a stored object, a run of chunks) of at least this many bytes
    #: is read on the pool's threads, whose reads and checks of it release the
    #: interpreter lock; a smaller one on the calling thread, meanwhile: its work is
    #: mostly Python, and on the pool, taking turns for the lock, it cost more than it
    #: saved (64 MiB in 797 tensors: 1.2-1.6x the time on 4 threads as on one).
    PARALLEL_ITEM_BYTES = 1 << 20

    def __init__(
        self,
        store: Store,
        root: GroupMeta,
        arrays: Mapping[str, ArrayMeta],
        groups: Mapping[str, GroupMeta],
        *,
        max_read_bytes: int | None = None,
        workers: int | None = None,
    ) -> None:
        self.store = store
        self.root = root
        self.arrays = dict(arrays)
        self.groups = dict(groups)
        self.max_read_bytes = max_read_bytes if max_read_bytes is not None else physical_memory()
        self.stats = ReadStats()
        self._workers = workers  # None: twice the CPUs, 2 to 16, when the pool is made
        self._pool_size = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._readers: dict[str, ArrayReader] = {}

    # -- metadata ---------------------------------------------------------------------

    @property
    def location(self) -> str:
        return self.store.location

    @property
    def ucp(self) -> Mapping[str, Any]:
        """The root ``attributes.ucp`` object."""
        return self.root.ucp

    @property
    def version(self) -> str:
        return str(self.ucp["version"])

    @property
    def metadata(self) -> dict[str, Any]:
        """Free-form metadata given at save time (``attributes.ucp.metadata``)."""
        value = jsonvalues.decode(self.ucp.get("metadata", {}), where="metadata")
        return value if isinstance(value, dict) else {}

    def values(self, group: str = "") -> dict[str, Any]:
        """The JSON values stored in a group (``""`` is the root)."""
        meta = self.root if group == "" else self.groups.get(group)
        if meta is None:
            raise TensorNotFoundError(f"no group {group!r}", path=self.location)
        decoded = jsonvalues.decode(dict(meta.values), where=group or "/")
        assert isinstance(decoded, dict)
        return decoded

    def keys(self) -> list[str]:
        """Node paths of every tensor, sorted (``model/fc.weight``)."""
        return sorted(self.arrays)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.arrays)

    def __contains__(self, path: object) -> bool:
        return path in self.arrays

    def __getitem__(self, path: str) -> Tensor:
        meta = self.arrays.get(path)
        if meta is None:
            raise TensorNotFoundError(f"no tensor {path!r}", path=self.location)
        return Tensor(self, meta)

    def tensor(self, *logical_names: str) -> Tensor:
        """The tensor at a path of logical (unescaped) names: ``tensor("model", "fc.weight")``."""
        return self[names.path_of(*logical_names)]

    def tensors(self, prefix: str = "") -> Iterator[Tensor]:
        """Every tensor whose path starts with ``prefix`` (a group path)."""
        start = prefix.rstrip("/") + "/" if prefix else ""
        for path in self.keys():
            if path.startswith(start):
                yield Tensor(self, self.arrays[path])

    # -- whole-state access --------------------------------------------------------------

    def to_dict(self, prefix: str = "", *, exclude: Sequence[str] = ()) -> dict[str, Any]:
        """Read a group (default: everything) back into a nested mapping of logical names;
        the nodes under the group paths ``exclude`` (and those groups) are left out."""
        if prefix and prefix not in self.groups:
            raise TensorNotFoundError(f"no group {prefix!r}", path=self.location)
        out: dict[str, Any] = dict(self.values(prefix))
        start = prefix + "/" if prefix else ""
        left_out = tuple(e + "/" for e in exclude)

        def wanted(path: str) -> bool:
            return path.startswith(start) and not (path + "/").startswith(left_out)

        for path in sorted(self.groups):
            if path != prefix and wanted(path):
                node = _nest(out, path[len(start):])
                node.update(self.values(path))
        for path in self.keys():
            if wanted(path):
                rel = path[len(start):]
                parent, _, leaf = rel.rpartition("/")
                _nest(out, parent)[names.unescape(leaf)] = self[path].read()
        return out

    # -- reading ------------------------------------------------------------------------

    def check_new_arrays(self, sizes: Sequence[tuple[str, int]]) -> None:
        """Refuse, before anything is allocated, new arrays of ``(tensor path, bytes)`` for
        a read whose bytes, one alone or all together, exceed :attr:`max_read_bytes` (the
        caller's stated bound; by default the memory this process can have): a declared
        shape of 2^40 rows over tiny chunks must not be allocated first (UCP-1.0-R090)."""
        total = 0
        for path, nbytes in sizes:
            total += nbytes
            if total > self.max_read_bytes:
                what = (f"{nbytes} bytes" if total == nbytes
                        else f"{nbytes} bytes, {total} with the tensors read with it")
                raise ResourceLimitError(
                    f"a new array for it needs {what}, over the limit of "
                    f"{self.max_read_bytes} (read a slice, load into existing tensors, or "
                    "open with a larger max_read_bytes)", rule="UCP-1.0-R090", tensor=path)

    def read_regions(self, regions: Sequence[Region]) -> list[np.ndarray[Any, Any]]:
        """Read many boxes, of one tensor or many, as one batch; the arrays, in order.

        Each box is read as :meth:`Tensor.read_region` reads it (``out`` included), but
        the shard indexes of every box and then every inner chunk are read by the
        checkpoint's pool of threads together, so that small tensors do not each wait
        for their own round trip. Inner chunks that lie back to back in a shard are read
        with one request (up to :attr:`RUN_BYTES`) and checked one by one.
        """
        with gc_paused():  # (thousands of small objects, no cycles: see gc_paused)
            return self._read_regions(regions)

    def _read_regions(self, regions: Sequence[Region]) -> list[np.ndarray[Any, Any]]:
        outs: list[np.ndarray[Any, Any]] = []
        jobs: list[tuple[ArrayReader, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                         np.ndarray[Any, Any]]] = []
        sizes: list[int] = []  # the bytes of ``out`` each job fills, about
        for region in regions:
            meta = self._meta(region.path)
            out, lo, hi = self._prepare(meta, region.starts, region.stops, region.out)
            outs.append(out)
            if out.size == 0:
                continue
            reader = self._reader(meta)
            objects = objects_overlapping(meta, lo, hi)
            jobs.extend((reader, coords, lo, hi, out) for coords in objects)
            sizes.extend([out.nbytes // len(objects)] * len(objects))
        # one batch of the store: what it opens once (a LocalStore: the location's
        # directory) serves every read of every thread, instead of being opened per read
        serial = sum(out.nbytes for out in outs) <= self.SERIAL_BYTES
        with self.store.batch():
            planned = self._map(_plan, jobs, sizes=sizes, serial=serial)
            runs = [
                (job[0], run, job[2], job[3], job[4])
                for job, reads in zip(jobs, planned, strict=True) if reads
                for run in group_runs(reads, self.RUN_BYTES)
            ]
            self._map(lambda r: r[0].read_run(r[1], r[2], r[3], r[4]), runs,
                      sizes=[sum(c.nbytes or self.RUN_BYTES for c in r[1]) for r in runs],
                      serial=serial)
        return outs

    def read_whole(self, paths: Sequence[str], *, mapped: bool = False
                   ) -> list[np.ndarray[Any, Any]]:
        """Every tensor at ``paths``, whole, as new arrays, in order: one batch
        (:meth:`read_regions`), refused before anything is allocated when they exceed
        :attr:`max_read_bytes` together (UCP-1.0-R090).

        ``mapped``: a tensor stored as one uncompressed unsharded chunk on a local file
        system is instead a view of its file mapped copy-on-write, handed out once its
        CRC32C has been checked over the mapping (:meth:`ArrayReader.map_whole`): no copy,
        and writes to it never reach the file. It relies on the checkpoint's files not
        being changed in place while it lives (UCP-1.0-R053)."""
        with gc_paused():
            return self._read_whole(paths, mapped)

    def _read_whole(self, paths: Sequence[str], mapped: bool) -> list[np.ndarray[Any, Any]]:
        metas = [self._meta(path) for path in paths]
        self.check_new_arrays([(m.path, m.nbytes) for m in metas])
        arrays: list[np.ndarray[Any, Any] | None] = [None] * len(metas)
        maps = [i for i, m in enumerate(metas) if self._reader(m).mappable] if mapped else []
        with self.store.batch():  # (one for both passes: read_regions' nests in it)
            if maps:
                mapped_arrays = self._map(
                    ArrayReader.map_whole, [self._reader(metas[i]) for i in maps],
                    sizes=[metas[i].nbytes for i in maps],
                    serial=sum(metas[i].nbytes for i in maps) <= self.SERIAL_BYTES)
                for i, array in zip(maps, mapped_arrays, strict=True):
                    arrays[i] = array
            rest = [i for i, a in enumerate(arrays) if a is None]
            if rest:  # (none when every tensor was mapped: one get_tensor's common case)
                read = self.read_regions([Region(metas[i].path, (0,) * len(metas[i].shape),
                                                 metas[i].shape) for i in rest])
                for i, array in zip(rest, read, strict=True):
                    arrays[i] = array
        return [a for a in arrays if a is not None]

    def _meta(self, path: str) -> ArrayMeta:
        meta = self.arrays.get(path)
        if meta is None:
            raise TensorNotFoundError(f"no tensor {path!r}", path=self.location)
        return meta

    def _reader(self, meta: ArrayMeta) -> ArrayReader:
        """The reader of an array of this checkpoint, made once: what it works out about
        the array's layout serves every read of it. (It counts into :attr:`stats`, not
        through the checkpoint: a checkpoint that held its readers and was held by them
        would be freed only by the cyclic collector.)"""
        reader = self._readers.get(meta.path)
        if reader is None:
            reader = self._readers[meta.path] = ArrayReader(self.store, meta, self.stats.count)
        return reader

    def map_box(self, path: str, starts: Sequence[int], stops: Sequence[int]
                ) -> np.ndarray[Any, Any] | None:
        """The box ``[starts, stops)`` of the tensor at ``path``, checked as a read checks
        it (:meth:`_prepare`, UCP-1.0-R090) and copied out of its mapping
        (:meth:`ArrayReader.map_whole`: the chunk's CRC32C checked over the mapping
        first), where the tensor is one uncompressed chunk of a store that maps; None
        otherwise (read it). A slice of such a tensor checks the whole chunk either way;
        mapped, it is not first read into new memory."""
        meta = self._meta(path)
        reader = self._reader(meta)
        if not reader.mappable:
            return None
        whole = reader.map_whole()
        if whole is None:
            return None
        out, lo, hi = self._prepare(meta, starts, stops, None)  # the checks of a read
        np.copyto(out, whole[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))])
        return out

    def _prepare(
        self, meta: ArrayMeta, starts: Sequence[int], stops: Sequence[int],
        out: np.ndarray[Any, Any] | None,
    ) -> tuple[np.ndarray[Any, Any], tuple[int, ...], tuple[int, ...]]:
        """Check a region request; the array it is read into (``out`` or a new one) and
        the region's bounds as integers."""
        shape = meta.shape
        if len(starts) != len(shape) or len(stops) != len(shape):
            raise SelectionError(f"a region of rank {len(shape)} is needed", tensor=meta.path)
        zeros = (0,) * len(shape)
        if stops is shape and starts == zeros:  # the whole tensor (read_whole, Tensor.read)
            lo, hi = zeros, shape
        else:
            for a, b, n in zip(starts, stops, shape, strict=True):
                if not 0 <= a <= b <= n:
                    raise SelectionError(
                        f"region [{list(starts)}, {list(stops)}) is outside shape {list(shape)}",
                        tensor=meta.path,
                    )
            lo = tuple(int(a) for a in starts)
            hi = tuple(int(b) for b in stops)
        out_shape = tuple(b - a for a, b in zip(lo, hi, strict=True))
        nbytes = math.prod(out_shape) * meta.dtype.itemsize
        if out is not None:
            if tuple(out.shape) != out_shape or out.dtype != meta.dtype.numpy:
                raise SelectionError(
                    f"out is {out.dtype} of shape {list(out.shape)}; the region needs "
                    f"{meta.dtype.numpy} of shape {list(out_shape)}",
                    tensor=meta.path,
                )
            if not out.flags.writeable:
                raise SelectionError("out is read-only", tensor=meta.path)
        elif nbytes > self.max_read_bytes:
            raise ResourceLimitError(
                f"reading region of shape {list(out_shape)} needs {nbytes} bytes, over the "
                f"limit of {self.max_read_bytes} (read a smaller slice, or raise "
                "max_read_bytes)",
                rule="UCP-1.0-R090",
                tensor=meta.path,
            )
        chunk_nbytes = math.prod(meta.chunk_shape) * meta.dtype.itemsize
        if nbytes and chunk_nbytes > self.max_read_bytes:
            raise ResourceLimitError(
                f"its chunks of shape {list(meta.chunk_shape)} decode to {chunk_nbytes} bytes "
                f"each, over the limit of {self.max_read_bytes} (raise "
                "max_read_bytes to read it)",
                rule="UCP-1.0-R090",
                tensor=meta.path,
            )
        if out is None:
            out = new_array(out_shape, meta.dtype.numpy)
        return out, lo, hi

    def _map(self, fn: Any, items: Sequence[Any], *, sizes: Sequence[int] | None = None,
             serial: bool = False) -> list[Any]:
        """``[fn(item) for item in items]``, the items of at least
        :attr:`PARALLEL_ITEM_BYTES` (``sizes``; all if None) on the checkpoint's pool of
        threads, the others on the calling thread, which then helps with the large ones;
        ``serial``: all on the calling thread."""
        shared = [i for i in range(len(items))
                  if sizes is None or sizes[i] >= self.PARALLEL_ITEM_BYTES]
        if len(items) <= 1 or serial or not shared:
            return [fn(item) for item in items]
        with self._pool_lock:
            if self._pool is None:
                # (asked here, not on open: asking the system for its CPUs costs 30 µs)
                self._pool_size = self._workers or max(2, min(16, 2 * (os.cpu_count() or 1)))
                self._pool = ThreadPoolExecutor(self._pool_size)
            pool, workers = self._pool, self._pool_size
        # One task per worker, each taking the next item until none is left: a future per
        # item cost more than reading a small tensor (thousands of tensors per load).
        # A failure stops the work early: no task takes another item once one failed. It
        # is raised only once every task has ended (the tasks write into the caller's
        # arrays, a live tensor's memory, which must not change after the caller has seen
        # the error), and it is the failure of the first item in order among those that
        # failed.
        results: list[Any] = [None] * len(items)
        failures: dict[int, BaseException] = {}
        chosen = set(shared)
        own = iter([i for i in range(len(items)) if i not in chosen])
        cursor = iter(shared)
        lock = threading.Lock()

        def work(queue: Iterator[int]) -> None:
            while True:
                with lock:
                    i = -1 if failures else next(queue, -1)
                if i < 0:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:
                    with lock:
                        failures[i] = exc
                    return

        futures = [pool.submit(work, cursor) for _ in range(min(workers, len(shared)))]
        try:
            work(own)
            work(cursor)
        finally:
            wait(futures)
        for f in futures:
            f.result()
        if failures:
            raise failures[min(failures)]
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<ucpformat.Checkpoint {self.location!r} version={self.version} "
            f"tensors={len(self)}>"
        )


def _plan(job: tuple[ArrayReader, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                     np.ndarray[Any, Any]]) -> list[ChunkRead]:
    """The chunk reads of one stored object of a batch; a small object wanted whole is
    read at once instead (one request), leaving nothing to read."""
    reader, coords, lo, hi, out = job
    if reader.read_object_in_one(coords, lo, hi, out):
        return []
    bound = reader.whole_object_bound(coords, lo, hi)
    if bound is not None:
        return reader.read_whole_object(coords, lo, hi, out, bound)
    return reader.plan_object(coords, lo, hi, out)


def _nest(out: dict[str, Any], rel_path: str) -> dict[str, Any]:
    node = out
    if rel_path:
        for part in rel_path.split("/"):
            node = node.setdefault(names.unescape(part), {})
    return node


class Tensor:
    """A lazy handle on one stored tensor; index it to read a numpy array."""

    def __init__(self, checkpoint: Checkpoint, meta: ArrayMeta) -> None:
        self.checkpoint = checkpoint
        self.meta = meta

    @property
    def path(self) -> str:
        return self.meta.path

    @property
    def name(self) -> str:
        """Logical name (the last component of the path, unescaped)."""
        return names.unescape(self.meta.path.rpartition("/")[2])

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.dtype.numpy

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    @property
    def attributes(self) -> Mapping[str, Any]:
        """The array's ``attributes.ucp`` object (role, layout semantics, ...)."""
        return self.meta.ucp

    def __repr__(self) -> str:
        return f"<ucpformat.Tensor {self.path!r} shape={self.shape} dtype={self.meta.dtype.name}>"

    def read(self) -> np.ndarray[Any, Any]:
        """The whole tensor."""
        return self.read_region((0,) * self.ndim, self.shape)

    def __getitem__(self, selection: Any) -> np.ndarray[Any, Any]:
        starts, stops, post = _parse_selection(selection, self.shape, self.path)
        box = self.checkpoint.map_box(self.path, starts, stops)
        return _apply_post(box if box is not None else self.read_region(starts, stops), post)

    def read_region(
        self,
        starts: Sequence[int],
        stops: Sequence[int],
        *,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """The box ``[starts, stops)`` of the tensor, reading only what overlaps it.

        ``out``: a writeable array of the region's shape and the tensor's data type to
        read into (and return), e.g. a view of a framework tensor's memory; where it is
        C-contiguous, uncompressed row blocks go from storage straight into it.
        """
        return self.checkpoint.read_regions([Region(self.path, starts, stops, out)])[0]


@dataclass(frozen=True)
class Region:
    """A box of a tensor to read: ``[starts, stops)`` of the tensor at node ``path``;
    ``out`` as for :meth:`Tensor.read_region` (None: a new array)."""

    path: str
    starts: Sequence[int]
    stops: Sequence[int]
    out: np.ndarray[Any, Any] | None = None


def _parse_selection(
    selection: Any, shape: tuple[int, ...], where: str
) -> tuple[list[int], list[int], list[Any]]:
    """Basic numpy indexing -> bounding box [starts, stops) and per-axis post-selection.

    The post-selection holds, per axis, None (keep all), an int (pick one, drop the axis)
    or an index array (stepped slices), relative to the box.
    """
    if not isinstance(selection, tuple):
        selection = (selection,)
    ellipses = [k for k, s in enumerate(selection) if s is Ellipsis]
    if len(ellipses) > 1:
        raise SelectionError("an index can only have one ellipsis", tensor=where)
    if ellipses:
        i = ellipses[0]
        fill = len(shape) - (len(selection) - 1)
        selection = selection[:i] + (slice(None),) * fill + selection[i + 1 :]
    if len(selection) > len(shape):
        raise SelectionError(f"too many indices for a tensor of rank {len(shape)}", tensor=where)
    selection = selection + (slice(None),) * (len(shape) - len(selection))
    starts: list[int] = []
    stops: list[int] = []
    post: list[Any] = []
    for sel, n in zip(selection, shape, strict=True):
        if isinstance(sel, int | np.integer) and not isinstance(sel, bool):
            i = int(sel) + n if sel < 0 else int(sel)
            if not 0 <= i < n:
                raise SelectionError(f"index {sel} is out of range for size {n}", tensor=where)
            starts.append(i)
            stops.append(i + 1)
            post.append(0)
        elif isinstance(sel, slice):
            a, b, step = sel.indices(n)
            picked = range(a, b, step)
            if step == 1 or len(picked) == 0:
                starts.append(a if len(picked) else 0)
                stops.append(max(a, b) if len(picked) else 0)
                post.append(None)
            else:
                lo = min(picked[0], picked[-1])
                starts.append(lo)
                stops.append(max(picked[0], picked[-1]) + 1)
                post.append(np.asarray(picked, dtype=np.intp) - lo)
        else:
            raise SelectionError(
                f"only integers, slices and ... are supported, got {type(sel).__name__}",
                tensor=where,
            )
    return starts, stops, post


def _apply_post(region: np.ndarray[Any, Any], post: Sequence[Any]) -> np.ndarray[Any, Any]:
    for axis in reversed(range(len(post))):
        op = post[axis]
        if op is None:
            continue
        region = np.take(region, op, axis=axis)
    return region


# -- open ------------------------------------------------------------------------------------


def open_checkpoint(
    path: str | os.PathLike[str] | Store,
    *,
    max_read_bytes: int | None = None,
    workers: int | None = None,
    max_metadata_bytes: int | None = None,
) -> Checkpoint:
    """Open a committed checkpoint: one read of the root metadata, checked strictly.

    ``max_metadata_bytes``: the largest root zarr.json read (default
    :func:`metadata_limit`); a larger one is refused before it is read (UCP-1.0-R098).
    """
    store = read_guarded(path)
    checked = read_checked_root(store, limit=metadata_limit(max_metadata_bytes, max_read_bytes),
                                keep_document=False)
    return Checkpoint(store, checked.root, checked.arrays, checked.groups,
                      max_read_bytes=max_read_bytes, workers=workers)


@dataclass(frozen=True)
class CheckedRoot:
    """A committed checkpoint's root zarr.json: its bytes, its document and the nodes it
    consolidates, every check of opening passed (:func:`read_checked_root`)."""

    raw: bytes | None  # kept only if asked (a copy writes it as it is)
    doc: dict[str, Any] | None  # kept unless asked not to (opening needs only the nodes)
    root: GroupMeta
    arrays: dict[str, ArrayMeta]
    groups: dict[str, GroupMeta]


def read_checked_root(store: Store, *, limit: int, keep_raw: bool = False,
                      keep_document: bool = True) -> CheckedRoot:
    """Read the root zarr.json of ``store`` (refused over ``limit`` bytes, UCP-1.0-R098,
    or absent, UCP-1.0-R051), check its digest (UCP-1.0-R058) and parse every node it
    consolidates: what opening a checkpoint checks. Its bytes are let go before the
    nodes are parsed (the parse's memory is bounded by a multiple of their size) unless
    ``keep_raw``; the parsed document is let go too unless ``keep_document``.

    The garbage collector is paused from the parse until then (not during the read):
    resumed while the document lived, its first collection would traverse all of it (a
    tenth of opening 797 tensors), though it holds no cycle and is freed by its
    reference count."""
    raw = read_root(store, limit=limit)
    with gc_paused():
        doc: dict[str, Any] | None = loads(raw, what=f"{store.location}/{ZARR_JSON}")
        check_root_digest(raw, doc, where=store.location)
        kept = raw if keep_raw else None
        del raw
        root, arrays, groups = parse_root(doc, where=store.location)
        if not keep_document:
            doc = None
    return CheckedRoot(kept, doc, root, arrays, groups)


def metadata_limit(max_metadata_bytes: int | None, max_read_bytes: int | None) -> int:
    """The largest metadata document a reader reads (UCP-1.0-R098): ``max_metadata_bytes``
    if given, else :data:`MAX_METADATA_BYTES`, and never so large that parsing it (at most
    :data:`METADATA_MEMORY_FACTOR` bytes of memory per byte) could exceed ``max_read_bytes``
    (but at least :data:`MIN_METADATA_BYTES`)."""
    if max_metadata_bytes is not None:
        return max_metadata_bytes
    memory = max_read_bytes if max_read_bytes is not None else physical_memory()
    return min(MAX_METADATA_BYTES, max(MIN_METADATA_BYTES, memory // METADATA_MEMORY_FACTOR))


def read_metadata(
    store: Store, key: str, *, limit: int, what: str = "", size: int | None = None
) -> bytes | None:
    """A metadata document's bytes (None if absent), refused before it is read when it is
    larger than ``limit`` (UCP-1.0-R098): never more than ``limit`` bytes are read.
    ``size``: the document's size, if the caller has it from a listing (not asked again)."""
    size = store.size(key) if size is None else size
    if size is None:
        return None

    def too_big(size: int) -> ResourceLimitError:
        return ResourceLimitError(
            f"{what or key} is {size} bytes or more, over the limit of {limit} for a "
            "metadata document (refused unread; raise max_metadata_bytes to read it)",
            rule="UCP-1.0-R098",
            path=f"{store.location}/{key}",
        )

    if size > limit:
        raise too_big(size)
    raw = store.get_range(key, 0, limit + 1)  # the file may have grown since
    if raw is not None and len(raw) > limit:
        raise too_big(size)
    return raw


def read_root(store: Store, *, limit: int) -> bytes:
    """The root zarr.json's bytes; an incomplete or absent checkpoint is refused (UCP-1.0-R051)."""
    raw = read_metadata(store, ZARR_JSON, limit=limit, what="the root zarr.json")
    if raw is not None:
        return raw
    if store.exists(IN_PROGRESS_KEY):
        raise IncompleteCheckpointError(
            "this checkpoint was never committed (a save is in progress or was "
            "interrupted): it has no root zarr.json",
            rule="UCP-1.0-R051",
            path=store.location,
        )
    if store.is_empty():
        raise CheckpointNotFoundError("no checkpoint here", rule="UCP-1.0-R051",
                                      path=store.location)
    raise IncompleteCheckpointError(
        "no root zarr.json: not a committed UCP checkpoint", rule="UCP-1.0-R051",
        path=store.location,
    )


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def parse_root(
    doc: Any, *, where: str
) -> tuple[GroupMeta, dict[str, ArrayMeta], dict[str, GroupMeta]]:
    """Check the root zarr.json document (the commit) and every node it consolidates.

    This is everything ``open`` checks before it returns; it reads nothing else.
    """
    check_root_members(doc, where=where)
    root = parse_group("", doc, root=True)
    ucp = root.attributes.get("ucp")
    if not isinstance(ucp, Mapping):
        raise FormatError(
            "the root group has no attributes.ucp object: not a UCP checkpoint",
            rule="UCP-1.0-R002",
            path=where,
        )
    # members of ucp (and of attributes) that this reader does not know are ignored,
    # never refused (UCP-1.0-R062): only must_understand names what must be understood
    parse_version(ucp.get("version"), where=where)
    check_root_digest_member(ucp, where=where)
    must = ucp.get("must_understand", [])
    if (
        not isinstance(must, list)
        or not all(isinstance(m, str) for m in must)
        or len(set(must)) != len(must)
    ):
        raise FormatError("attributes.ucp.must_understand must be a list of distinct strings",
                          rule="UCP-1.0-R061", path=where)
    unknown = sorted(set(must) - UNDERSTOOD_FEATURES)
    if unknown:
        raise UnsupportedFeatureError(
            f"this checkpoint needs features this reader does not implement: {unknown}",
            rule="UCP-1.0-R061",
            path=where,
        )
    manifest = ucp.get("manifest")
    if (
        not isinstance(manifest, Mapping)
        or manifest.get("path") != MANIFEST_KEY
        or not _is_count(manifest.get("nbytes"))
        or not isinstance(manifest.get("sha256"), str)
        or not _SHA256_RE.match(manifest["sha256"])
    ):
        raise FormatError(
            f"attributes.ucp.manifest must be {{'path': {MANIFEST_KEY!r}, 'nbytes': <int>, "
            f"'sha256': <hex>}}, got {manifest!r}",
            rule="UCP-1.0-R042",
            path=where,
        )
    producer = ucp.get("producer", {})
    if not isinstance(producer, Mapping) or not all(
        isinstance(producer.get(k, ""), str) for k in ("name", "version")
    ):
        raise FormatError("attributes.ucp.producer must be an object with string name and "
                          "version", rule="UCP-1.0-R002", path=where)
    created = ucp.get("created", "2000-01-01T00:00:00Z")
    if not isinstance(created, str) or not DATE_TIME.match(created):
        raise FormatError("attributes.ucp.created must be an RFC 3339 date-time string",
                          rule="UCP-1.0-R002", path=where)
    for member in ("metadata", "values"):
        if member in ucp:
            check_values(ucp[member], what=f"attributes.ucp.{member}", where=where)
    with gc_paused():
        arrays, groups = parse_consolidated(doc, where=where)
    check_aliases(arrays, groups, where=where)
    return root, arrays, groups


def check_aliases(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], *, where: str
) -> None:
    """Refuse what UCP-1.0-R108 forbids, on open: an alias that is also stored (a loader
    would hand out its target's values under a stored tensor's name), one that points to
    another alias or to no array of its group. A malformed ``aliases`` member is left to
    validation (its schema)."""
    for gpath, group in groups.items():
        aliases = group.ucp.get("aliases")
        if not isinstance(aliases, Mapping):
            continue
        for alias, target in aliases.items():
            if not isinstance(alias, str) or not isinstance(target, str):
                continue
            try:
                alias_path = names.join(gpath, names.escape(alias))
                target_path = names.join(gpath, names.escape(target))
            except UCPError as exc:
                raise FormatError(f"alias {alias!r} -> {target!r}: {exc.message}",
                                  rule="UCP-1.0-R108", path=where, tensor=gpath) from exc
            if alias_path in arrays:
                raise FormatError(
                    f"is declared an alias of {target!r} in {gpath!r} and is also stored: "
                    "an alias is not stored (refused: a loader would give it the values of "
                    f"{target!r})", rule="UCP-1.0-R108", tensor=alias_path)
            if target in aliases:
                raise FormatError(f"alias {alias!r} points to another alias {target!r}",
                                  rule="UCP-1.0-R108", tensor=gpath)
            if target_path not in arrays:
                raise FormatError(f"alias {alias!r} points to {target!r}, which is not an "
                                  "array of this group", rule="UCP-1.0-R108", tensor=gpath)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


ROOT_MEMBERS = frozenset({"zarr_format", "node_type", "attributes", "consolidated_metadata"})
CONSOLIDATED_MEMBERS = frozenset({"kind", "must_understand", "metadata"})


def check_root_members(doc: Any, *, where: str) -> None:
    """UCP-1.0-R057: the root and its consolidated metadata have only the members UCP
    defines, so that no byte of the root can change unnoticed (UCP-1.0-R045, UCP-1.0-R055)."""
    if not isinstance(doc, Mapping):
        return  # parse_group reports it
    extra = sorted(set(doc) - ROOT_MEMBERS)
    cm = doc.get("consolidated_metadata")
    if isinstance(cm, Mapping):
        extra += sorted(f"consolidated_metadata.{k}" for k in set(cm) - CONSOLIDATED_MEMBERS)
    if extra:
        raise FormatError(
            f"the root zarr.json has members UCP does not define: {extra[:5]} (damaged, or "
            "not written by a UCP writer)",
            rule="UCP-1.0-R057",
            path=where,
        )


def parse_consolidated(
    doc: Mapping[str, Any], *, where: str
) -> tuple[dict[str, ArrayMeta], dict[str, GroupMeta]]:
    """Parse the consolidated metadata of the root: every node, checked."""
    cm = doc.get("consolidated_metadata")
    if (
        not isinstance(cm, Mapping)
        or cm.get("kind") != "inline"
        or not isinstance(cm.get("metadata"), Mapping)
        or cm.get("must_understand", False) is not False
    ):
        raise FormatError(
            "the root zarr.json must hold consolidated metadata of kind 'inline'",
            rule="UCP-1.0-R052",
            path=where,
        )
    arrays: dict[str, ArrayMeta] = {}
    groups: dict[str, GroupMeta] = {}
    here = f"{where}: consolidated metadata"
    for path, node in cm["metadata"].items():
        if path == "":  # the root's own path: never one of its nodes (a node has a name)
            raise UnsafePathError(
                "the consolidated metadata has an entry for the empty path; every node "
                "there has a name", rule="UCP-1.0-R010", path=here,
            )
        names.check_path(path, where=here)
        if not isinstance(node, Mapping):
            raise FormatError(f"metadata of {path!r} is not an object", rule="UCP-1.0-R001",
                              path=where)
        kind = node.get("node_type")
        if kind == "array":
            arrays[path] = parse_array(path, node)
        elif kind == "group":
            groups[path] = parse_group(path, node)
        else:
            raise FormatError(f"node {path!r} has node_type {kind!r}", rule="UCP-1.0-R001",
                              path=where)
    for path in [*arrays, *groups]:
        parent = path.rpartition("/")[0]
        if parent and parent not in groups:
            raise FormatError(
                f"node {path!r} has no parent group {parent!r} in the consolidated metadata",
                rule="UCP-1.0-R005",
                path=where,
            )
    return arrays, groups
