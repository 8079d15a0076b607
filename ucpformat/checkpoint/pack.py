"""A committed checkpoint copied between its two forms: a directory and one file.

:func:`pack` writes a checkpoint as one file, a ZIP archive (spec §11.5, UCP-1.0-R074: a
distributed save writes a directory, which is then packed); :func:`unpack` writes one as a
directory. Both copy exactly the objects of the committed checkpoint, byte for byte:
every file its manifest lists (its stored objects and node ``zarr.json`` documents), the
``zarr.json`` of every node of its consolidated metadata, the manifest and the root. Files
beside them (an in-progress marker, anything else) are never copied.

The source is checked before anything is written: it must open as a committed checkpoint
(UCP-1.0-R051), and by default a deep validation reads every byte of it (every CRC32C,
every SHA-256 of its manifest, the ZIP CRC-32 of each member of an archive) and any error
refuses it, so that damage is refused, not propagated. While copying, each object must
hold the number of bytes the manifest gives (UCP-1.0-R043), and the manifest the bytes
the root seals.

The copy follows the commit protocol (:mod:`ucpformat.checkpoint.commit`) into either
form: the destination is claimed (a checkpoint there is refused unless ``overwrite``),
the stored objects are written, then the node documents, then the manifest; all of it is
made durable; the root, written last, commits the copy (spec §11.1). An archive is
written beside its path and renamed onto it by :meth:`ArchiveWriter.commit`, so a failed
pack leaves the path as it was (UCP-1.0-R074); a failed unpack removes what it wrote, and
a checkpoint it was replacing in a directory is gone (it was un-committed first,
UCP-1.0-R053), as the error says.

Objects are read on a few threads, ahead of the writes by at most
:data:`READ_AHEAD_BYTES`, and written in one order (stored objects by key, then the node
documents by path), so that packing a checkpoint twice makes the same file.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucpformat.checkpoint.commit import (
    WriteClaim,
    check_destination,
    create_owned,
    explain_failure,
    prepare_destination,
    storage_errors,
    write_root,
)
from ucpformat.checkpoint.metadata import (
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    ZARR_JSON,
    loads,
)
from ucpformat.checkpoint.reader import metadata_limit, read_checked_root, read_metadata
from ucpformat.checkpoint.validation import validate
from ucpformat.checkpoint.writer import SaveResult
from ucpformat.errors import (
    CheckpointExistsError,
    CorruptDataError,
    FormatError,
    InvalidValueError,
    MissingChunkError,
)
from ucpformat.progress import ProgressCallback, byte_progress
from ucpformat.store import (
    ArchiveStore,
    ArchiveWriter,
    LocalStore,
    Store,
    is_archive_path,
    open_store,
    read_guarded,
    unguarded,
)

#: An object is read into pieces of at most this many bytes (and written from them).
PIECE_BYTES = 64 << 20
#: The bytes read ahead of the writes, at most (one object larger than this is read alone).
READ_AHEAD_BYTES = 256 << 20
#: The threads that read objects, by default.
DEFAULT_WORKERS = 4


@dataclass(frozen=True)
class PackResult(SaveResult):
    """What a pack or unpack wrote: :class:`SaveResult`'s counts (``location`` is the
    destination, ``nbytes`` the tensors' bytes, ``objects`` the stored objects), and
    every file copied (``files``: the stored objects, the node documents, the manifest
    and the root) with their bytes (``file_bytes``)."""

    files: int = 0
    file_bytes: int = 0


def pack(
    source: str | os.PathLike[str] | Store,
    archive: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    durable: bool = True,
    verify: bool = True,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
) -> PackResult:
    """Write the committed checkpoint at ``source`` (a directory, usually: what a
    distributed save writes; or any location) as one file at ``archive``, a ZIP archive
    (spec §11.5; its name should end in ``.ucpz``, UCP-1.0-R078).

    ``verify`` (default): validate the source deeply first (every byte read and checked)
    and refuse it on any error; without it, only what opening it checks, the manifest's
    seal and each object's size. A file at ``archive`` is refused unless ``overwrite``,
    and then replaced in one rename only if it is a checkpoint in one file; a failure
    leaves ``archive`` as it was and no partial file. ``durable``: the archive is on disk
    (fsync) before its name is given to it. ``progress``: a bar on stderr (True) or a
    callable given each increment of bytes (verified, then copied).
    """
    target = Path(os.fspath(archive).removeprefix("file://"))
    store = read_guarded(source)
    try:
        _refuse_overlap(store, target.absolute(), into_archive=True)
        # the writer refuses what is at the path at once, before the source is read
        with ArchiveWriter(target, overwrite=overwrite, durable=durable) as writer:
            checked = _checked_source(store, verify=verify, progress=progress)
            result = _copy(checked, writer, overwrite=overwrite, workers=workers,
                           progress=progress, label="packing")
            writer.commit()
    finally:
        _close(store, source)
    return result


def unpack(
    source: str | os.PathLike[str] | Store,
    directory: str | os.PathLike[str] | Store,
    *,
    overwrite: bool = False,
    durable: bool = True,
    verify: bool = True,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
) -> PackResult:
    """Write the committed checkpoint at ``source`` (one file, usually: an archive; or any
    location) as a directory at ``directory`` (or into any writable location: a URL, a
    :class:`~ucpformat.store.Store`), through the commit protocol as a save writes it.

    ``verify``, ``workers`` and ``progress`` as for :func:`pack`. A checkpoint at
    ``directory`` is refused unless ``overwrite``, a directory of other files always
    (UCP-1.0-R066); a failure removes what the unpack wrote and says whether a checkpoint
    it was replacing is gone (it is: the protocol un-commits it first, UCP-1.0-R053).
    """
    if not isinstance(directory, Store) and is_archive_path(directory):
        raise InvalidValueError(
            "unpack writes a directory, and this path names a file (or ends in .ucpz): "
            "give a directory path (ucp pack writes one file)", rule="UCP-1.0-R074",
            path=os.fspath(directory))
    reads = read_guarded(source)
    try:
        store = open_store(directory, durable=durable)
        _refuse_overlap(reads, None, destination=store)
        with storage_errors(store, untouched=True):
            check_destination(store, overwrite=overwrite)  # at once, before the source is read
        checked = _checked_source(reads, verify=verify, progress=progress)
        return _copy(checked, store, overwrite=overwrite, workers=workers, progress=progress,
                     label="unpacking")
    finally:
        _close(reads, source)


# -- the source -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A committed checkpoint, checked, and what is copied of it."""

    store: Store
    #: (key, bytes) of every object to copy but the manifest and the root, in the order
    #: they are written: the stored objects by key, then the node documents by path.
    objects: list[tuple[str, int]]
    #: How many of ``objects`` are stored objects (the rest are node documents).
    stored: int
    manifest: bytes
    root: bytes
    tensors: int
    tensor_bytes: int


def _checked_source(store: Store, *, verify: bool, progress: bool | ProgressCallback
                    ) -> _Source:
    """Open ``store`` as a committed checkpoint, validate it (deeply if ``verify``) and
    refuse it on any error; list what is copied of it."""
    limit = metadata_limit(None, None)
    checked = read_checked_root(store, limit=limit, keep_raw=True)  # none: UCP-1.0-R051
    arrays, groups = checked.arrays, checked.groups
    report = validate(store, deep=verify, progress=progress)
    if report.errors:
        first = report.errors[0]
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise FormatError(
            f"the source is not a valid checkpoint, so it is not copied: {first.path}: "
            f"{first.message}{more}; nothing was written (`ucp validate"
            f"{' --deep' if verify else ''} {store.location}` lists every problem)",
            rule=first.rule, path=store.location)
    assert checked.doc is not None  # (kept: read_checked_root's default)
    manifest, files = _manifest(store, checked.doc, limit=limit)
    nodes = [f"{path}/{ZARR_JSON}" for path in sorted({*arrays, *groups})]  # as written
    metadata = {ZARR_JSON, MANIFEST_KEY, IN_PROGRESS_KEY, *nodes}
    stored = sorted((k, n) for k, n in files.items() if k not in metadata)
    documents = [(k, files[k] if k in files else _size_of(store, k)) for k in nodes]
    assert checked.raw is not None
    return _Source(store, [*stored, *documents], len(stored), manifest, checked.raw,
                   tensors=len(arrays), tensor_bytes=sum(m.nbytes for m in arrays.values()))


def _manifest(store: Store, root: Mapping[str, Any], *, limit: int
              ) -> tuple[bytes, dict[str, int]]:
    """The manifest's bytes, checked against the size and SHA-256 the root gives
    (UCP-1.0-R043), and the size of every file it lists."""
    ref = root["attributes"]["ucp"]["manifest"]  # parse_root checked its shape
    raw = read_metadata(store, MANIFEST_KEY, limit=limit, what="the manifest")
    if raw is None:
        raise MissingChunkError("the manifest is missing", rule="UCP-1.0-R042",
                                path=f"{store.location}/{MANIFEST_KEY}")
    if len(raw) != ref["nbytes"] or hashlib.sha256(raw).hexdigest() != ref["sha256"]:
        raise CorruptDataError("the manifest differs from the size and SHA-256 the root "
                               "gives; nothing was written", rule="UCP-1.0-R043",
                               path=f"{store.location}/{MANIFEST_KEY}")
    doc = loads(raw, what=MANIFEST_KEY, rule="UCP-1.0-R042")
    files = doc.get("files") if isinstance(doc, Mapping) else None
    if not isinstance(files, Mapping) or not all(
            isinstance(e, Mapping) and _is_count(e.get("nbytes")) for e in files.values()):
        raise FormatError("the manifest has no files object giving each file's nbytes",
                          rule="UCP-1.0-R042", path=f"{store.location}/{MANIFEST_KEY}")
    return raw, {str(k): int(e["nbytes"]) for k, e in files.items()}


def _close(store: Store, given: object) -> None:
    """Close the archive this module opened to read (not one the caller gave)."""
    inner = unguarded(store)
    if isinstance(inner, ArchiveStore) and not isinstance(given, Store):
        inner.close()


def _size_of(store: Store, key: str) -> int:
    size = store.size(key)
    if size is None:
        raise MissingChunkError(f"{key} is missing", rule="UCP-1.0-R055",
                                path=f"{store.location}/{key}")
    return size


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _local_path(store: Store) -> Path | None:
    """The resolved file-system path of a local store (None for other stores)."""
    inner = unguarded(store)
    if isinstance(inner, ArchiveStore):
        return inner.path.resolve()
    return inner.root.resolve() if isinstance(inner, LocalStore) else None


def _refuse_overlap(source: Store, archive: Path | None, *, into_archive: bool = False,
                    destination: Store | None = None) -> None:
    """Refuse a destination that is the source, lies inside it (the copy would add a file
    to a committed checkpoint, UCP-1.0-R053) or holds it (replacing the destination would
    delete the source)."""
    src = _local_path(source)
    dst = archive.resolve() if archive is not None else (
        _local_path(destination) if destination is not None else None)
    if src is None or dst is None:
        return
    if into_archive and dst == src:
        return  # an archive repacked onto itself: written beside it, renamed onto it
    if dst == src or src in dst.parents or dst in src.parents:
        raise CheckpointExistsError(
            "the destination is the source checkpoint, lies inside it or holds it: copy "
            "it to a path outside it; nothing was written", rule="UCP-1.0-R053",
            path=str(dst))


# -- the copy -------------------------------------------------------------------------


def _copy(source: _Source, store: Store, *, overwrite: bool, workers: int | None,
          progress: bool | ProgressCallback, label: str) -> PackResult:
    """Claim ``store``, copy ``source``'s objects into it in the protocol's order and
    commit it with ``source``'s root."""
    total = sum(n for _, n in source.objects) + len(source.manifest) + len(source.root)
    with storage_errors(store), store.batch():
        with storage_errors(store, untouched=True):
            claim = prepare_destination(store, overwrite=overwrite)
        with explain_failure(store, claim), storage_errors(store), \
                byte_progress(progress, total, label) as advance:
            reads = _read_ahead(source.store, source.objects, workers or DEFAULT_WORKERS)
            try:
                for key, pieces in reads:
                    _create(store, claim, key, pieces)
                    advance(sum(len(p) for p in pieces))
            finally:
                reads.close()  # a failed write: the reads ahead stop before the clean-up
            _create(store, claim, MANIFEST_KEY, [source.manifest])
            store.flush()  # everything before the root is durable before it (UCP-1.0-R050)
            write_root(store, source.root, written=[k for k, _ in source.objects],
                       claim=claim)
            advance(len(source.manifest) + len(source.root))
    return PackResult(store.location, source.tensors, source.tensor_bytes, source.stored,
                      files=len(source.objects) + 2, file_bytes=total)


def _create(store: Store, claim: WriteClaim, key: str, buffers: Sequence[Any]) -> None:
    """Create ``key``, never replacing another writer's object (UCP-1.0-R059)."""
    create_owned(store, claim, key, lambda: store.create(key, buffers))


def _read_ahead(store: Store, objects: Sequence[tuple[str, int]], workers: int
                ) -> Generator[tuple[str, list[bytearray]], None, None]:
    """(key, its bytes in pieces) of every object, in the order given, read on
    ``workers`` threads at most :data:`READ_AHEAD_BYTES` ahead of the caller."""
    pending: deque[tuple[str, int, Future[list[bytearray]]]] = deque()
    ahead = 0
    todo = iter(objects)
    pool = ThreadPoolExecutor(max(1, workers))
    try:
        following = next(todo, None)
        while following is not None or pending:
            while following is not None and (not pending
                                             or ahead + following[1] <= READ_AHEAD_BYTES):
                key, size = following
                pending.append((key, size, pool.submit(_read, store, key, size)))
                ahead += size
                following = next(todo, None)
            key, size, future = pending.popleft()
            pieces = future.result()
            ahead -= size
            yield key, pieces
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read(store: Store, key: str, size: int) -> list[bytearray]:
    """The ``size`` bytes of ``key`` in pieces of at most :data:`PIECE_BYTES`; an object
    that is missing, or holds another number of bytes, is refused (UCP-1.0-R031,
    UCP-1.0-R043)."""
    pieces = [bytearray(min(PIECE_BYTES, size - at)) for at in range(0, size, PIECE_BYTES)]
    got = store.read_into(key, 0, [*pieces, bytearray(1)])  # one byte more: a longer object
    where = f"{store.location}/{key}"
    if got is None:
        raise MissingChunkError("listed in the manifest but missing", rule="UCP-1.0-R031",
                                path=where)
    if got != size:
        held = f"more than {size}" if got > size else f"{got}"
        raise CorruptDataError(f"holds {held} bytes, the manifest says {size}",
                               rule="UCP-1.0-R043", path=where)
    return pieces

__all__ = ["DEFAULT_WORKERS", "PIECE_BYTES", "READ_AHEAD_BYTES", "PackResult", "pack",
           "unpack"]
