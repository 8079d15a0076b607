"""The read path of stored objects: from a box of an array to bytes in caller memory.

For each stored object that overlaps the box, :meth:`ArrayReader.plan_object` lists the
inner chunks to read (for a shard, from its CRC-checked index); :func:`group_runs` groups
chunks that lie back to back in one object into runs; :meth:`ArrayReader.read_run` reads
a run with one request and checks every chunk's CRC32C. Uncompressed row blocks land
straight in the caller's array (zero copy), others are decoded and copied. A chunk that
must exist and does not is an error, never fill values.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ucpformat.engine.checksum import CRC_BYTES, crc32c
from ucpformat.engine.grid import inner_chunk_ranges
from ucpformat.engine.shard_index import EMPTY, decode_index, encode_index, index_nbytes
from ucpformat.errors import ChecksumError, CorruptDataError, MissingChunkError
from ucpformat.store import ReadOnceStore, Store

if TYPE_CHECKING:
    from ucpformat.checkpoint.metadata import ArrayMeta

#: Scratch space a read allocates around the wanted rows of an unsharded chunk before it
#: checks that the stored object is really that large.
UNCHECKED_SCRATCH_BYTES = 1 << 20
#: Bytes an encoded chunk may hold beyond twice its decoded size (UCP-1.0-R098): no
#: compressor of the closed list needs that much (zstd, gzip and blosc add at most a
#: few bytes per block, and headers).
ENCODING_SLACK = 1 << 16


#: A stored object that a read wants whole and that holds at most this many bytes is
#: read with one request, its index and its chunks together (one open of its file instead
#: of two), and checked from memory (:meth:`ArrayReader.read_whole_object`).
WHOLE_OBJECT_BYTES = 512 << 10


def packed_index(chunks: int, stored: int) -> bytes:
    """The shard index, its CRC32C included, of ``chunks`` inner chunks of ``stored``
    bytes each, stored back to back from byte 0 in grid order: what this library writes.
    The indexes of up to 4,096 chunks (64 KiB) are remembered, the last 256 of them."""
    return _packed_index(chunks, stored) if chunks <= 4096 else _pack_index(chunks, stored)


@functools.lru_cache(maxsize=256)
def _packed_index(chunks: int, stored: int) -> bytes:
    return _pack_index(chunks, stored)


def _pack_index(chunks: int, stored: int) -> bytes:
    entries = np.empty((chunks, 2), dtype="<u8")
    entries[:, 0] = np.arange(chunks, dtype="<u8") * stored
    entries[:, 1] = stored
    return encode_index(entries)


#: An array smaller than this is read, not mapped (:meth:`ArrayReader.map_whole`): a
#: mapping costs two system calls and a mapping of the process's own, a small read less;
#: except from a store whose mappings are views of one (:attr:`Store.maps_from_one_mapping`).
MAP_MIN_BYTES = 64 << 10

#: An object of at most this many bytes that a read wants whole is read with one request
#: (:meth:`ArrayReader.read_object_in_one`); a larger one in runs that several threads
#: share.
IN_ONE_BYTES = 16 << 20


def max_encoded_nbytes(decoded: int) -> int:
    """The largest stored size of a chunk of ``decoded`` bytes (CRC32C included), UCP-1.0-R098."""
    return 2 * decoded + ENCODING_SLACK


@dataclass(frozen=True)
class ChunkRead:
    """One chunk to read: object key, byte range (None: the whole object), where it goes."""

    key: str
    offset: int
    nbytes: int | None
    lo: tuple[int, ...]  # global coordinates of the chunk's first element
    chunk: tuple[int, ...]  # global chunk coordinates (for messages)
    #: The plan checked the range against its object's size (UCP-1.0-R094): a read of it
    #: need not ask for the size again before allocating for it.
    within: bool = False


def group_runs(reads: Sequence[ChunkRead], limit: int) -> list[list[ChunkRead]]:
    """Chunk reads grouped into runs that lie back to back in one stored object."""
    runs: list[list[ChunkRead]] = []
    ordered = sorted(reads, key=lambda r: (r.key, r.offset))
    size = 0
    for read in ordered:
        if (
            runs
            and read.nbytes is not None
            and size + read.nbytes <= limit
            and (last := runs[-1][-1]).key == read.key
            and last.nbytes is not None
            and last.offset + last.nbytes == read.offset
        ):
            runs[-1].append(read)
            size += read.nbytes
        else:
            runs.append([read])
            size = read.nbytes or 0
    return runs


class ArrayReader:
    """Reads boxes of one array's stored objects into caller memory, checking every chunk.

    ``count`` is told the size of every read (a checkpoint's read statistics).
    """

    def __init__(self, store: Store, meta: ArrayMeta, count: Callable[[int], None]) -> None:
        self.store = store
        self.meta = meta
        self.path = meta.path
        self._count = count

    # -- counted storage reads ------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        data = self.store.get(key)
        if data is not None:
            self._count(len(data))
        return data

    def _get_range(self, key: str, offset: int, length: int) -> bytes | None:
        data = self.store.get_range(key, offset, length)
        if data is not None:
            self._count(len(data))
        return data

    def _get_suffix_and_size(self, key: str, length: int) -> tuple[bytes | None, int | None]:
        got = self.store.get_suffix_and_size(key, length)
        if got is None:
            return None, None
        self._count(len(got[0]))
        return got

    def _read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        got = self.store.read_into(key, offset, buffers)
        if got is not None:
            self._count(got)
        return got

    # -- object and chunk reads ---------------------------------------------------------

    def _chunk_label(self, global_chunk: Sequence[int], key: str) -> str:
        return f"({', '.join(str(c) for c in global_chunk)}) [object {key}]"

    def _check_crc(self, global_chunk: Sequence[int], key: str, stored: Any,
                   computed: int) -> None:
        """Refuse the chunk if its ``computed`` CRC32C is not the ``stored`` four bytes
        (UCP-1.0-R041), naming the tensor, the chunk and its object."""
        stored = bytes(stored)
        if computed.to_bytes(CRC_BYTES, "little") != stored:
            raise ChecksumError(
                f"chunk {self._chunk_label(global_chunk, key)} fails its CRC32C check "
                f"(stored {stored.hex()}, computed "
                f"{computed.to_bytes(CRC_BYTES, 'little').hex()})",
                rule="UCP-1.0-R041",
                tensor=self.path,
            )

    def _missing(self, what: str) -> MissingChunkError:
        return MissingChunkError(
            f"{what} is missing; a non-sparse array stores every chunk, so this checkpoint "
            "is incomplete or damaged (never read as fill values)",
            rule="UCP-1.0-R031",
            tensor=self.path,
        )

    def _oversized(self, label: str, size: str, bound: int) -> CorruptDataError:
        return CorruptDataError(
            f"chunk {label} is stored in {size}, more than any encoding of its "
            f"{math.prod(self.meta.chunk_shape) * self.meta.dtype.itemsize} bytes takes "
            f"({bound}: twice its size plus {ENCODING_SLACK}); refused unread",
            rule="UCP-1.0-R098",
            tensor=self.path,
        )

    def _overlap(
        self, chunk_lo: Sequence[int], req_lo: Sequence[int], req_hi: Sequence[int]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """(source box in the chunk, destination box in the output), or None if disjoint."""
        src, dst = [], []
        for lo, n, a, b in zip(chunk_lo, self.meta.chunk_shape, req_lo, req_hi, strict=True):
            s, e = max(lo, a), min(lo + n, b)
            if s >= e:
                return None
            src.append((s - lo, e - lo))
            dst.append((s - a, e - a))
        return src, dst

    def _place(
        self,
        chunk_lo: Sequence[int],
        chunk: np.ndarray[Any, Any] | None,
        req_lo: Sequence[int],
        req_hi: Sequence[int],
        out: np.ndarray[Any, Any],
    ) -> None:
        """Copy the overlap of a chunk (at global ``chunk_lo``) into ``out`` (None: fill)."""
        ov = self._overlap(chunk_lo, req_lo, req_hi)
        if ov is None:
            return
        src, dst = ov
        target = tuple(slice(a, b) for a, b in dst)
        if chunk is None:
            out[target] = self.meta.fill_value
        else:
            out[target] = chunk[tuple(slice(a, b) for a, b in src)]

    def plan_object(
        self,
        coords: tuple[int, ...],
        req_lo: tuple[int, ...],
        req_hi: tuple[int, ...],
        out: np.ndarray[Any, Any],
    ) -> list[ChunkRead]:
        """The chunk reads one stored object contributes (reads a shard's index)."""
        meta = self.meta
        key = meta.object_key(coords)
        obj_lo = [c * e for c, e in zip(coords, meta.object_shape, strict=True)]
        if meta.shard_shape is None:
            return [ChunkRead(key, 0, None, tuple(obj_lo), tuple(coords))]
        cs = meta.chunk_shape
        cps = meta.chunks_per_shard
        local_ranges = inner_chunk_ranges(meta, coords, req_lo, req_hi)
        isize = index_nbytes(cps)
        # (one call: the store opens the shard once for its index and its size)
        raw_index, shard_size = self._get_suffix_and_size(key, isize)
        # (the shard's index, checked first, bounds the list below by the shard's size)
        needed = (
            list(itertools.product(*local_ranges))
            if raw_index is None or len(raw_index) == isize
            else []
        )
        if raw_index is None:
            if meta.sparse:
                for local in needed:
                    chunk_lo = tuple(o + i * c for o, i, c in zip(obj_lo, local, cs, strict=True))
                    self._place(chunk_lo, None, req_lo, req_hi, out)
                return []
            raise self._missing(f"shard {key}")
        if len(raw_index) != isize:
            raise CorruptDataError(
                f"shard {key} is truncated ({len(raw_index)} bytes, its index alone is {isize})",
                rule="UCP-1.0-R041",
                tensor=self.path,
            )
        index = decode_index(raw_index, cps, tensor=self.path, shard=key)
        max_encoded = max_encoded_nbytes(math.prod(cs) * meta.dtype.itemsize)
        reads = []
        for local in needed:
            offset, nbytes = (int(v) for v in index[local])
            glo = tuple(o + i * c for o, i, c in zip(obj_lo, local, cs, strict=True))
            gchunk = tuple(g // c for g, c in zip(glo, cs, strict=True))
            if offset == int(EMPTY) and nbytes == int(EMPTY):
                if meta.sparse:
                    self._place(glo, None, req_lo, req_hi, out)
                    continue
                raise self._missing(f"inner chunk {self._chunk_label(gchunk, key)}")
            if nbytes > max_encoded and offset < 2**62 and nbytes < 2**62:
                size = shard_size
                if size is not None and offset + nbytes > size:
                    raise CorruptDataError(
                        f"inner chunk {self._chunk_label(gchunk, key)} is cut short: its "
                        f"shard is {size} bytes, its index says it ends at {offset + nbytes}",
                        rule="UCP-1.0-R094",
                        tensor=self.path,
                    )
                raise self._oversized(self._chunk_label(gchunk, key), f"{nbytes} bytes",
                                      max_encoded)
            if offset >= 2**62 or nbytes >= 2**62:
                raise CorruptDataError(
                    f"inner chunk {self._chunk_label(gchunk, key)} has an impossible index entry "
                    f"(offset {offset}, {nbytes} bytes)",
                    rule="UCP-1.0-R041",
                    tensor=self.path,
                )
            if shard_size is not None and offset + nbytes > shard_size - isize:
                # inner chunks lie before the index (UCP-1.0-R048), and inside the shard
                # (UCP-1.0-R094)
                beyond = offset + nbytes > shard_size
                raise CorruptDataError(
                    f"inner chunk {self._chunk_label(gchunk, key)} has the index entry (offset "
                    f"{offset}, {nbytes} bytes), which reaches "
                    f"{'beyond the end of its shard' if beyond else 'into the shard index'} "
                    f"(a shard of {shard_size} bytes whose index starts at byte "
                    f"{shard_size - isize})",
                    rule="UCP-1.0-R094" if beyond else "UCP-1.0-R048",
                    tensor=self.path,
                )
            reads.append(ChunkRead(key, offset, nbytes, glo, gchunk,
                                   within=shard_size is not None))
        return reads

    def _read_chunk(
        self,
        read: ChunkRead,
        req_lo: tuple[int, ...],
        req_hi: tuple[int, ...],
        out: np.ndarray[Any, Any],
    ) -> None:
        """Read, verify and place one chunk; uncompressed row blocks go straight into ``out``."""
        meta = self.meta
        label = self._chunk_label(read.chunk, read.key)
        ov = self._overlap(read.lo, req_lo, req_hi)
        if ov is None:
            return
        src, dst = ov
        cs = meta.chunk_shape
        view = self._direct(read, src, dst, out)
        if view is not None:
            payload = math.prod(cs) * meta.dtype.itemsize
            self._read_rows_into(read, src, view, payload, label)
            return
        if read.nbytes is None:
            bound = max_encoded_nbytes(math.prod(cs) * meta.dtype.itemsize)
            data = self._get_range(read.key, 0, bound + 1)
            if data is None:
                if meta.sparse:
                    self._place(read.lo, None, req_lo, req_hi, out)
                    return
                raise self._missing(f"chunk {label}")
            if len(data) > bound:
                raise self._oversized(label, f"{len(data)} bytes or more", bound)
        else:
            data = self._get_range(read.key, read.offset, read.nbytes)
            if data is None or len(data) != read.nbytes:
                raise CorruptDataError(
                    f"chunk {label} is cut short: its shard is smaller than its index says",
                    rule="UCP-1.0-R094",
                    tensor=self.path,
                )
        chunk = meta.codec.decode(data, cs, tensor=self.path, chunk=label)
        self._place(read.lo, chunk, req_lo, req_hi, out)

    def _read_rows_into(
        self,
        read: ChunkRead,
        src: Sequence[tuple[int, int]],
        view: np.ndarray[Any, Any],
        payload: int,
        label: str,
    ) -> None:
        """Zero-copy path: the chunk's wanted rows land in ``view``; the rest in scratch."""
        meta = self.meta
        row = payload // meta.chunk_shape[0] if meta.chunk_shape else payload
        before = src[0][0] * row if meta.chunk_shape else 0
        middle = view.reshape(-1).view(np.uint8).data
        after = payload - before - len(middle)
        if read.nbytes is None and before + after > UNCHECKED_SCRATCH_BYTES:
            # Allocate scratch for the unwanted rows only once the object is that large
            # (UCP-1.0-R094): metadata alone cannot make a reader allocate.
            size = self.store.size(read.key)
            if size is not None and size != payload + CRC_BYTES:
                raise CorruptDataError(
                    f"chunk {label} is {size} bytes, expected {payload + CRC_BYTES}",
                    rule="UCP-1.0-R041",
                    tensor=self.path,
                )
        head = bytearray(before)
        tail = bytearray(after + CRC_BYTES + (1 if read.nbytes is None else 0))
        got = self._read_into(read.key, read.offset, [head, middle, tail])
        if got is None:
            if meta.sparse:
                view[...] = meta.fill_value
                return
            raise self._missing(f"chunk {label}")
        expected = payload + CRC_BYTES
        if got != expected:
            # a shard whose index points past its end (UCP-1.0-R094), or a chunk of the wrong size
            beyond = read.nbytes is not None and got < expected
            raise CorruptDataError(
                f"chunk {label} holds {got - CRC_BYTES if got >= CRC_BYTES else got} bytes"
                f"{' or more' if got > expected else ''}, expected {payload}"
                f"{': its shard is smaller than its index says' if beyond else ''}",
                rule="UCP-1.0-R094" if beyond else "UCP-1.0-R041",
                tensor=self.path,
            )
        self._verify(read, head, middle, tail, after)

    def _direct(self, read: ChunkRead, src: Sequence[tuple[int, int]],
                dst: Sequence[tuple[int, int]], out: np.ndarray[Any, Any]) -> Any:
        """The rows of ``out`` a chunk can be read into without a copy, or None.

        Uncompressed chunks that span every dimension but the first (row blocks) and whose
        wanted rows are contiguous in ``out`` qualify.
        """
        meta = self.meta
        cs = meta.chunk_shape
        if meta.compression is not None or meta.dtype.kind == "bool":
            return None  # (bool chunks are decoded: every byte is checked, UCP-1.0-R008)
        if any(src[d] != (0, cs[d]) for d in range(1, len(cs))):
            return None
        payload = math.prod(cs) * meta.dtype.itemsize
        if read.nbytes is not None and read.nbytes != payload + CRC_BYTES:
            return None
        rows: tuple[Any, ...] = (*(slice(a, b) for a, b in dst), Ellipsis)
        view = out[rows]
        return view if view.flags.c_contiguous else None

    def whole_object_bound(
        self, coords: tuple[int, ...], req_lo: tuple[int, ...], req_hi: tuple[int, ...]
    ) -> int | None:
        """The most bytes the shard at ``coords`` can hold if the box ``[req_lo, req_hi)``
        wants every inner chunk of it and that bound is at most :data:`WHOLE_OBJECT_BYTES`
        (a small shard read whole); None otherwise."""
        meta = self.meta
        if meta.shard_shape is None:
            return None  # an unsharded chunk is one request already
        for d, (a, b) in enumerate(zip(req_lo, req_hi, strict=True)):
            origin = coords[d] * meta.object_shape[d]
            if a > origin or b < min(origin + meta.object_shape[d], meta.shape[d]):
                return None
        chunk = math.prod(meta.chunk_shape) * meta.dtype.itemsize
        each = chunk + CRC_BYTES if meta.compression is None else max_encoded_nbytes(chunk)
        bound = math.prod(meta.chunks_per_shard) * each + index_nbytes(meta.chunks_per_shard)
        return bound if bound <= WHOLE_OBJECT_BYTES else None

    def read_whole_object(
        self,
        coords: tuple[int, ...],
        req_lo: tuple[int, ...],
        req_hi: tuple[int, ...],
        out: np.ndarray[Any, Any],
        bound: int,
    ) -> list[ChunkRead]:
        """Read a small shard (``bound``: :meth:`whole_object_bound`) with one request, then
        plan, check and place its chunks from memory exactly as :meth:`plan_object` and
        :meth:`read_run` do from the store. Returns the chunk reads still to make from the
        store: none, unless the object is larger than the bound (a damaged shard), which
        is then planned from the store as any other."""
        key = self.meta.object_key(coords)
        data = self.store.get_range(key, 0, bound + 1)
        if data is None or len(data) > bound:
            return self.plan_object(coords, req_lo, req_hi, out)
        self._count(len(data))
        memory = ReadOnceStore(self.store)
        memory.hold(key, data)
        held = ArrayReader(memory, self.meta, lambda n: None)
        for run in group_runs(held.plan_object(coords, req_lo, req_hi, out), bound + 1):
            held.read_run(run, req_lo, req_hi, out)
        return []

    @functools.cached_property
    def mappable(self) -> bool:
        """Whether :meth:`map_whole` may map the array: one uncompressed, unsharded chunk
        of a non-empty tensor of at least :data:`MAP_MIN_BYTES` (a smaller one is read),
        or of any size where the store's mappings are views of one."""
        meta = self.meta
        return not (
            meta.compression is not None
            or meta.dtype.kind == "bool"  # (decoded: every byte is checked, UCP-1.0-R008)
            or meta.shard_shape is not None
            or meta.chunk_shape != meta.shape
            or meta.nbytes == 0
            or (meta.nbytes < MAP_MIN_BYTES and not self.store.maps_from_one_mapping)
        )

    def map_whole(self) -> np.ndarray[Any, Any] | None:
        """The whole array as a view of its stored object mapped copy-on-write
        (:meth:`Store.map_copy_on_write`), once the CRC32C of its chunk has been checked
        over the mapping (UCP-1.0-R041; the check reads every page, which the caller's
        first touch would otherwise fault in): where the array is :attr:`mappable` and the
        store maps. A write to the array changes this process's copy only. None
        otherwise (read it instead); a failed check is raised as a read raises it.

        The chunk's bytes start at byte 0 of its file, so the view is aligned for any
        data type. A sharded array's chunks are each followed by their CRC32C: its values
        are never contiguous in the file, and are read (:meth:`read_object_in_one`)."""
        if not self.mappable:
            return None
        meta = self.meta
        shape = meta.shape
        payload = math.prod(shape) * meta.dtype.itemsize
        coords = tuple(0 for _ in shape)
        key = meta.object_key(coords)
        mapped = self.store.map_copy_on_write(  # (a small array: a view, or it is read)
            key, payload + CRC_BYTES, view_only=payload < MAP_MIN_BYTES)
        if mapped is None:
            return None
        self._count(payload + CRC_BYTES)
        view = memoryview(mapped)
        self._check_crc(coords, key, view[payload:], crc32c(view[:payload]))
        return np.frombuffer(mapped, dtype=meta.dtype.numpy, count=math.prod(shape)).reshape(
            shape)

    def read_object_in_one(
        self,
        coords: tuple[int, ...],
        req_lo: tuple[int, ...],
        req_hi: tuple[int, ...],
        out: np.ndarray[Any, Any],
    ) -> bool:
        """Read the stored object at ``coords`` with one request straight into ``out``,
        when the read wants the whole array into a C-contiguous ``out``, the array is
        uncompressed, its chunks are row blocks (they span every dimension but the first)
        and the object is laid out as this library writes it: its inner chunks back to
        back from byte 0 in grid order, each followed by its CRC32C, then the index.
        Every chunk's rows land in ``out`` in place (a last chunk's rows beyond the array
        in scratch), its CRC32C and the shard index are checked from memory before this
        returns (UCP-1.0-R041): a failed check is raised as the chunk-by-chunk read raises
        it.

        False where the array or the object is not so (another layout, an absent, shorter
        or longer object): ``out``'s rows for this object may then hold anything, and
        the caller reads them again chunk by chunk (:meth:`plan_object`), whose errors
        say precisely what is wrong; so is an object over :data:`IN_ONE_BYTES`. One
        request and checks from memory instead of an index read, a plan and a read per
        run: for thousands of small tensors, the Python around each read cost more than
        the read."""
        layout = self._in_one
        shape = self.meta.shape
        if layout is None or any(req_lo) or req_hi != shape or not out.flags.c_contiguous:
            return False
        row, rows, chunks, isize = layout
        payload = rows * row
        first = coords[0] * chunks * rows if shape else 0  # the object's first row
        end = shape[0] if shape else 1
        if chunks * payload > IN_ONE_BYTES or first + (chunks - 1) * rows >= end:
            return False  # a chunk wholly beyond the array's edge: the slow path decides
        data = out.reshape(-1).view(np.uint8).data
        start = first * row
        stop = start + chunks * payload
        extra = bytearray(CRC_BYTES * chunks + isize + 1)  # the CRCs, the index, one more
        crcs = memoryview(extra)
        bodies = [data[lo : lo + payload] for lo in range(start, stop, payload)]
        buffers: list[Any] = [None] * (2 * chunks)  # each chunk's rows, then its CRC32C
        buffers[0::2] = bodies
        buffers[1::2] = [crcs[i : i + CRC_BYTES] for i in range(0, CRC_BYTES * chunks, CRC_BYTES)]
        beyond = None
        if stop > end * row:  # the last chunk's rows beyond the array's edge: scratch
            beyond = bytearray(stop - end * row)
            buffers.insert(len(buffers) - 1, beyond)
        buffers.append(crcs[CRC_BYTES * chunks :])
        key = self.meta.object_key(coords)
        got = self._read_into(key, 0, buffers)
        stored = payload + CRC_BYTES
        if got != chunks * stored + isize:
            return False
        if isize:
            raw = crcs[CRC_BYTES * chunks : CRC_BYTES * chunks + isize]
            if raw != packed_index(chunks, stored):  # (equal: its CRC32C is right too)
                cps = self.meta.chunks_per_shard
                decode_index(raw, cps, tensor=self.path, shard=key)  # its CRC (UCP-1.0-R041)
                return False
        computed = [crc32c(body) for body in bodies]
        if beyond is not None:
            computed[-1] = crc32c(beyond, computed[-1])
        if crcs[: CRC_BYTES * chunks] != struct.pack(f"<{chunks}I", *computed):
            cps = self.meta.chunks_per_shard
            for i, crc in enumerate(computed):  # the first chunk that fails, named
                local = (i, *(0 for _ in shape[1:])) if shape else ()
                chunk = tuple(c * n + j for c, n, j in zip(coords, cps, local, strict=True))
                self._check_crc(chunk, key, crcs[CRC_BYTES * i : CRC_BYTES * (i + 1)], crc)
        return True

    @functools.cached_property
    def _in_one(self) -> tuple[int, int, int, int] | None:
        """What :meth:`read_object_in_one` needs of the array, worked out once: the bytes
        of a row, the rows of a chunk, the chunks of an object and the bytes of its index
        (0: unsharded); None where its objects are not read so."""
        meta = self.meta
        shape = meta.shape
        cps = meta.chunks_per_shard
        if (
            meta.compression is not None
            or meta.dtype.kind == "bool"  # (decoded: every byte is checked, UCP-1.0-R008)
            or meta.chunk_shape[1:] != shape[1:]
            or any(n != 1 for n in cps[1:])
        ):
            return None
        row = math.prod(shape[1:]) * meta.dtype.itemsize
        rows = meta.chunk_shape[0] if shape else 1
        chunks = cps[0] if shape else 1
        if meta.shard_shape is None:
            return row, rows, chunks, 0
        if 20 * chunks > max(rows * row * chunks, 4096):
            return None  # an index far larger than the data: read it bounded, as planned
        return row, rows, chunks, index_nbytes(cps)

    def read_run(
        self,
        run: Sequence[ChunkRead],
        req_lo: tuple[int, ...],
        req_hi: tuple[int, ...],
        out: np.ndarray[Any, Any],
    ) -> None:
        """Read chunks that lie back to back in one shard with one request, then verify
        and place each: row blocks land in ``out`` directly, others are decoded."""
        if len(run) == 1:
            self._read_chunk(run[0], req_lo, req_hi, out)
            return
        meta = self.meta
        cs = meta.chunk_shape
        payload = math.prod(cs) * meta.dtype.itemsize
        row = payload // cs[0] if cs else payload
        key = run[0].key
        end = run[-1].offset + (run[-1].nbytes or 0)
        scratch_bytes = sum((r.nbytes or 0) for r in run)  # at most this much is not ``out``
        if scratch_bytes > UNCHECKED_SCRATCH_BYTES and not all(r.within for r in run):
            # the shard's index gave these ranges: allocate for them only once the shard is
            # known to hold them (UCP-1.0-R094)
            size = self.store.size(key)
            if size is not None and size < end:
                raise CorruptDataError(
                    f"chunk {self._chunk_label(run[-1].chunk, key)} is cut short: its shard "
                    f"is {size} bytes, its index says it ends at {end}",
                    rule="UCP-1.0-R094",
                    tensor=self.path,
                )
        buffers: list[Any] = []
        parts: list[tuple[ChunkRead, Any, Any]] = []
        for read in run:
            assert read.nbytes is not None
            ov = self._overlap(read.lo, req_lo, req_hi)
            view = None if ov is None else self._direct(read, ov[0], ov[1], out)
            if view is not None and ov is not None:
                before = ov[0][0][0] * row
                middle = view.reshape(-1).view(np.uint8).data
                head = bytearray(before)
                tail = bytearray(payload - before - len(middle) + CRC_BYTES)
                buffers += [head, middle, tail]
                parts.append((read, (head, middle, tail), view))
            else:
                scratch = bytearray(read.nbytes)
                buffers.append(scratch)
                parts.append((read, scratch, None))
        total = sum(r.nbytes or 0 for r in run)
        got = self._read_into(run[0].key, run[0].offset, buffers)
        if got is None:
            raise self._missing(f"shard {run[0].key}")
        pos = 0
        for read, data, view in parts:
            assert read.nbytes is not None
            if got < pos + read.nbytes:
                raise CorruptDataError(
                    f"chunk {self._chunk_label(read.chunk, read.key)} is cut short: its "
                    "shard is smaller than its index says",
                    rule="UCP-1.0-R094",
                    tensor=self.path,
                )
            pos += read.nbytes
            if view is None:
                label = self._chunk_label(read.chunk, read.key)
                chunk = meta.codec.decode(data, cs, tensor=self.path, chunk=label)
                self._place(read.lo, chunk, req_lo, req_hi, out)
            else:
                head, middle, tail = data
                self._verify(read, head, middle, tail, len(tail) - CRC_BYTES)
        assert pos == total

    def _verify(self, read: ChunkRead, head: Any, middle: Any, tail: Any, after: int) -> None:
        """Check the CRC32C of a chunk read in three parts (the last ends with the CRC)."""
        crc = crc32c(head)
        crc = crc32c(middle, crc)
        crc = crc32c(memoryview(tail)[:after], crc)
        self._check_crc(read.chunk, read.key, tail[after : after + CRC_BYTES], crc)
