"""A checkpoint in one file: the single-file form of spec §11.5 (a ZIP archive).

:class:`ArchiveStore` reads a committed archive: its members are the checkpoint's
objects, each found through the central directory and read (or mapped) in place.
:class:`ArchiveWriter` writes one: every object is appended to a new file beside the
path as it is written, and :meth:`ArchiveWriter.commit` adds the central directory,
makes the file durable and renames it onto the path, so that the path holds the old
archive or the new one, never a part (UCP-1.0-R074). An archive is never changed in
place: :class:`ArchiveStore` refuses writes.

Which paths are archives: :func:`is_archive_path` (a name ending in
:data:`ARCHIVE_SUFFIX`, or a regular file). The bytes of the ZIP records are
:mod:`ucpformat.store.zip_layout`'s.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import stat
import threading
import uuid
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from ucpformat.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConcurrentWriteError,
    CorruptDataError,
    StorageError,
    UCPError,
    WriteError,
)
from ucpformat.store import posix, zip_layout
from ucpformat.store.base import Store, StoreClaim, check_key, close_quietly
from ucpformat.store.posix import advance_views, pread_all
from ucpformat.store.zip_layout import Member

#: The name ending that makes a path an archive to write (UCP-1.0-R078).
ARCHIVE_SUFFIX = ".ucpz"
#: The largest central directory read (a metadata document, UCP-1.0-R098).
MAX_DIRECTORY_BYTES = 256 << 20
#: The name ending of the new file a writer writes beside its path.
PARTIAL_SUFFIX = ".partial"
#: The first bytes of a ZIP archive: a member's local header, or the end record of none.
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")
#: The key of the root metadata, which only a committed archive holds.
_ROOT_KEY = "zarr.json"


def has_archive_suffix(location: str | os.PathLike[str]) -> bool:
    """Whether a local path's name ends in :data:`ARCHIVE_SUFFIX` (a save there writes
    one file, UCP-1.0-R078)."""
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return False
    return text.lower().endswith(ARCHIVE_SUFFIX)


def is_archive_path(location: str | os.PathLike[str]) -> bool:
    """Whether a local path is read as a checkpoint in one file: a regular file is
    (whatever its name, UCP-1.0-R078), a directory is not (whatever its name), and a
    path with nothing there is if its name ends in :data:`ARCHIVE_SUFFIX`."""
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return False
    try:
        return stat.S_ISREG(os.stat(text.removeprefix("file://")).st_mode)
    except (OSError, ValueError):
        return has_archive_suffix(text)


def _read_only(location: str) -> WriteError:
    return WriteError(
        "this path names a checkpoint in one file (.ucpz), which only a save from one "
        "process writes (ucpformat.save, save_file, the streaming writer, `ucp convert`, "
        "`ucp pack`), whole; this writer writes a directory: save to a directory, then "
        "`ucp pack DIRECTORY FILE.ucpz`",
        rule="UCP-1.0-R074", path=location)


def _check_not_a_folder(members: Mapping[str, Member], location: str) -> None:
    """Refuse the commonest mistake, an archive of a checkpoint's folder (every member
    under ``<folder>/``, the root at ``<folder>/zarr.json``), saying how to make one."""
    if _ROOT_KEY in members or not members:
        return
    folders = {name.split("/", 1)[0] for name in members}
    folder = folders.pop()
    if not folders and f"{folder}/{_ROOT_KEY}" in members:
        raise CheckpointNotFoundError(
            f"no root zarr.json: every member is under {folder + '/'!r}, so this is an "
            "archive of a checkpoint's folder, not of the checkpoint; make one with "
            f"`ucp pack {folder} FILE.ucpz` (or zip from inside the folder: "
            f"`cd {folder} && zip -r -0 ../FILE.ucpz .`)",
            rule="UCP-1.0-R051", path=location)


def writes_archive(location: str | os.PathLike[str] | Store
                   ) -> TypeGuard[str | os.PathLike[str]]:
    """Whether a save to ``location`` writes one file: a local path whose name ends in
    :data:`ARCHIVE_SUFFIX`, or that is a regular file (never a :class:`Store` object)."""
    return not isinstance(location, Store) and (
        has_archive_suffix(location) or is_archive_path(location))


def check_directory_location(location: str | os.PathLike[str] | Store) -> None:
    """Refuse, before anything starts, a path that names a checkpoint in one file, for a
    writer that writes directories (a distributed save, DCP's, the async saver's): its
    error says to save to a directory and pack it (UCP-1.0-R074)."""
    if writes_archive(location):
        raise _read_only(os.fspath(location))


class _Members:
    """The members of an archive and the byte range each may occupy."""

    def __init__(self, members: dict[str, Member], directory_offset: int) -> None:
        self.by_name = members
        self.starts = sorted(m.header_offset for m in members.values())
        self.directory_offset = directory_offset
        self.data: dict[str, int] = {}  # name -> where its data starts, once checked

    def end_of(self, member: Member) -> int:
        """The first byte past what ``member`` may hold: the next header or the directory."""
        i = bisect.bisect_right(self.starts, member.header_offset)
        return self.starts[i] if i < len(self.starts) else self.directory_offset


class ArchiveStore(Store):
    """A committed checkpoint in one file, read only.

    The file is opened once, at the first read, and stays open until :meth:`close` (or
    until the store is collected); its central directory is read then and checked
    (UCP-1.0-R077), and each member's local header at its first read. A path with no
    file reads as an empty location (no checkpoint there). Reads are ``pread`` calls;
    :meth:`map_copy_on_write` maps a member in place when its data is aligned.
    """

    maps_from_one_mapping = True  # (the first mapping of a member is a view of the file's)

    def __init__(self, path: str | os.PathLike[str], *,
                 max_directory_bytes: int = MAX_DIRECTORY_BYTES) -> None:
        self.path = Path(os.fspath(path).removeprefix("file://")).absolute()
        self.location = str(self.path)
        self.max_directory_bytes = max_directory_bytes
        self._fd = -1
        self._members: _Members | None = None
        self._lock = threading.Lock()
        self._close: Any = None
        self._whole: Any = None  # the whole archive mapped copy-on-write, once
        self._handed_out: set[str] = set()  # members handed out as views of it

    # -- the file ---------------------------------------------------------------------

    def _opened(self) -> _Members | None:
        """The members, reading the directory at the first call; None with no file."""
        if self._members is not None:
            return self._members
        with self._lock:
            if self._members is None:
                try:
                    fd = os.open(self.location, os.O_RDONLY | os.O_CLOEXEC)
                except (FileNotFoundError, NotADirectoryError):
                    return None
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise StorageError("not a regular file, so not a checkpoint in one "
                                           "file", rule="UCP-1.0-R074", path=self.location)
                    if not has_archive_suffix(self.location) and \
                            pread_all(fd, 4, 0) not in _ZIP_STARTS:
                        raise CheckpointNotFoundError(
                            "not a checkpoint: a checkpoint is a directory, or one file that "
                            "is a ZIP archive (.ucpz), and this file is neither",
                            rule="UCP-1.0-R051", path=self.location)
                    members, directory = zip_layout.read_directory(
                        lambda offset, n: pread_all(fd, n, offset), st.st_size,
                        where=self.location, limit=self.max_directory_bytes)
                    _check_not_a_folder(members, self.location)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
                self._close = weakref.finalize(self, close_quietly, fd)
                self._members = _Members(members, directory)
        return self._members

    def close(self) -> None:
        """Close the file (reads after this open it again)."""
        with self._lock:
            if self._close is not None:
                self._close()
            self._close, self._fd, self._members = None, -1, None
            self._whole, self._handed_out = None, set()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to another process): the path, nothing open."""
        return {"path": self.path, "location": self.location,
                "max_directory_bytes": self.max_directory_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], max_directory_bytes=state["max_directory_bytes"])  # type: ignore[misc]

    def _locate(self, key: str) -> tuple[int, int] | None:
        """(where the member's data starts, its size), or None if there is none."""
        check_key(key)
        members = self._opened()
        member = members.by_name.get(key) if members is not None else None
        if members is None or member is None:
            return None
        start = members.data.get(key)
        if start is None:
            length, whole = zip_layout.local_header_bytes(member), self._whole
            if whole is not None:  # (the bytes of the file before its directory, mapped)
                header = bytes(memoryview(whole)[member.header_offset:
                                                 member.header_offset + length])
            else:
                header = pread_all(self._fd, length, member.header_offset)
            start = zip_layout.data_offset(header, member, members.end_of(member),
                                           where=self.location)
            members.data[key] = start
        return start, member.size

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self.get_range(key, 0, 1 << 62)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        found = self._locate(key)
        if found is None:
            return None
        start, size = found
        offset = min(max(0, offset), size)
        return self._pread(start + offset, min(length, size - offset), key)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        size = self.size(key)
        return None if size is None else self.get_range(key, max(0, size - length), length)

    def _pread(self, offset: int, length: int, key: str) -> bytes:
        data = pread_all(self._fd, length, offset)
        if len(data) != length:
            raise CorruptDataError(f"member {key!r} is cut short: the file ends inside it",
                                   rule="UCP-1.0-R077", path=self.location)
        return data

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        found = self._locate(key)
        if found is None:
            return None
        start, size = found  # never counted past the member: the next one's bytes follow
        return posix.preadv_until(self._fd, buffers, start + offset, start + size)

    def map_copy_on_write(self, key: str, size: int, *, view_only: bool = False
                          ) -> Any | None:
        """The member mapped privately in place (a write changes this process's copy,
        never the file), if it holds exactly ``size`` bytes and its data starts on a
        multiple of :data:`~ucpformat.store.zip_layout.ALIGNMENT` (so that a view of it
        is aligned for every data type); None otherwise (the caller reads it).

        A member's first mapping is a view of one mapping of the whole archive, made
        once per store (one system call for a load of thousands of tensors, as
        safetensors maps its file); a member mapped again gets a mapping of its own, so
        that two tensors never share memory (None instead with ``view_only``: the
        caller reads it)."""
        if self._whole is None and self._opened() is not None:
            with self._lock:
                if self._whole is None and self._members is not None:
                    self._whole = posix.map_private(self._fd,
                                                    self._members.directory_offset)
        found = self._locate(key)
        if found is None or found[1] != size or found[0] % zip_layout.ALIGNMENT:
            return None
        start = found[0]
        with self._lock:
            whole = None
            if key not in self._handed_out and self._whole is not None:
                whole = self._whole
                self._handed_out.add(key)
        if whole is not None:
            return memoryview(whole)[start:start + size]
        if view_only:
            return None
        page = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = posix.map_private(self._fd, start - page + size, page)
        return None if mapped is None else memoryview(mapped)[start - page:]

    def crc32_mismatches(self, block: int = 16 << 20) -> list[str]:
        """The members whose bytes differ from the ZIP CRC-32 their central entry gives
        (UCP-1.0-R075), each read in pieces of at most ``block`` bytes: what a deep
        validation checks, which a reader may skip (UCP-1.0-R077)."""
        members = self._opened()
        bad = []
        for name, member in (members.by_name.items() if members is not None else ()):
            start, size = self._locate(name) or (0, 0)
            crc, done = 0, 0
            while done < size:
                piece = self._pread(start + done, min(block, size - done), name)
                crc = zlib.crc32(piece, crc)
                done += len(piece)
            if crc != member.crc32:
                bad.append(name)
        return bad

    def size(self, key: str) -> int | None:
        check_key(key)
        members = self._opened()
        member = members.by_name.get(key) if members is not None else None
        return None if member is None else member.size

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _ in self.list_sizes(prefix):
            yield key

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        members = self._opened()
        start = f"{prefix}/" if prefix else ""
        for name, member in (members.by_name.items() if members is not None else ()):
            if name.startswith(start):
                yield name, member.size

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    # -- no writes --------------------------------------------------------------------

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        raise _read_only(self.location)

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        raise _read_only(self.location)

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        raise _read_only(self.location)

    def delete(self, key: str) -> None:
        raise _read_only(self.location)

    def delete_all(self) -> None:
        raise _read_only(self.location)

    def __repr__(self) -> str:
        return f"ArchiveStore({self.location!r})"


class ArchiveWriter(Store):
    """A new checkpoint in one file at ``path``, written by one process.

    Objects are appended to a new file beside ``path`` (``.<name>.<random>.partial``)
    from any number of threads, each member's data aligned (UCP-1.0-R076) and its
    CRC-32 computed as ZIP requires (UCP-1.0-R075). Nothing appears at ``path`` before
    :meth:`commit`; :meth:`discard` (or the writer's collection) removes the new file.
    A checkpoint already at ``path`` is refused at once unless ``overwrite``; with it,
    the commit replaces the file in one rename, and a path that holds something other
    than a checkpoint in one file is never replaced (UCP-1.0-R066).

    The claim of the save pipeline is the new file itself (created exclusively, seen by
    no one else): :meth:`claim` keeps its marker in memory, never in the archive. The new
    file is locked (``flock``) while it is written: a writer to the same path that finds
    a locked one refuses to start (UCP-1.0-R059), and one left by a writer that was
    killed (unlocked) is removed.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False,
                 durable: bool = True) -> None:
        self.path = Path(os.fspath(path).removeprefix("file://")).absolute()
        self.location = str(self.path)
        self.overwrite = overwrite
        self.durable = durable
        self._check_target()
        self._partial = self.path.with_name(
            f".{self.path.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")
        try:
            self._fd = os.open(self._partial,
                               os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create the new file {self._partial.name!r} beside "
                               f"it: {exc.strerror or exc}", rule="UCP-1.0-R074",
                               path=self.location) from exc
        self._finalizer = weakref.finalize(self, _remove, self._fd, str(self._partial))
        posix.try_lock(self._fd)  # held until the commit or the discard, or the process ends
        self._clear_partials()
        self._lock = threading.Lock()
        self._end = 0
        self._members: dict[str, tuple[Member, int]] = {}  # name -> (member, data start)
        self._claims: dict[str, bytes] = {}

    def _clear_partials(self) -> None:
        """Remove the new files of earlier writers to this path that were killed (their
        lock went with their process); refuse if one is still writing (UCP-1.0-R059)."""
        prefix = f".{self.path.name}."
        for entry in os.scandir(self.path.parent):
            if not (entry.name.startswith(prefix) and entry.name.endswith(PARTIAL_SUFFIX)) \
                    or entry.name == self._partial.name or not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile
            try:
                if posix.try_lock(fd) is False:
                    self.discard()
                    raise ConcurrentWriteError(
                        f"another writer is writing this file now ({entry.name!r} is "
                        "locked); at most one save writes a path at a time",
                        rule="UCP-1.0-R059", path=self.location)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)  # a killed writer's: no process holds it
            finally:
                os.close(fd)

    def _check_target(self) -> None:
        """Make the parent directory if it is missing, and refuse a path that holds what
        this save must not replace: a checkpoint (unless ``overwrite``), a directory, or
        another file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot make the directory {str(self.path.parent)!r}: "
                               f"{exc.strerror or exc}", path=self.location) from exc
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise CheckpointExistsError(
                "a directory is at this path; a checkpoint in one file never replaces one "
                "(remove it, or save to another path)", rule="UCP-1.0-R066",
                path=self.location)
        if not self.overwrite:
            raise CheckpointExistsError(
                "a file is already at this path; pass overwrite=True to replace a "
                "checkpoint", rule="UCP-1.0-R053", path=self.location)
        existing = ArchiveStore(self.path)
        try:
            holds = existing.exists(_ROOT_KEY)
        except UCPError as exc:
            holds, why = False, f" ({exc.message})"
        else:
            why = "" if holds else " (it has no root zarr.json)"
        finally:
            existing.close()
        if not holds:
            raise CheckpointExistsError(
                f"the file at this path is not a checkpoint in one file{why}; refusing to "
                "replace it (even with overwrite=True): remove it first, or save to "
                "another path", rule="UCP-1.0-R066", path=self.location)

    # -- writes -----------------------------------------------------------------------

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        """Append the object as a member (one that replaces a member of the same name
        leaves the old bytes unreferenced)."""
        check_key(key)
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        with self._lock:
            self._check_open()
            offset = self._end
            header = zip_layout.member_header(key, offset, size, crc)
            self._end = offset + len(header) + size
        todo = [memoryview(header), *(v for v in views if len(v))]
        written = 0
        while todo:
            n = os.pwritev(self._fd, todo[:posix.IOV_MAX], offset + written)
            written += n
            advance_views(todo, n)
        with self._lock:
            self._members[key] = (Member(key, offset, size, crc), offset + len(header))
        return size

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        if self.exists(key):
            raise FileExistsError(f"{key} is already in the archive")
        return self.put(key, buffers, atomic=atomic)

    atomic_create = True  # one process: the check and the append are not raced

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        with self._lock:
            self._claims[key] = body
        return StoreClaim(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._members.pop(key, None)
            self._claims.pop(key, None)

    def delete_keys(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def delete_all(self) -> None:
        with self._lock:
            self._members.clear()
            self._claims.clear()

    def flush(self) -> None:
        """Nothing: the archive is made durable whole, by :meth:`commit`."""

    def commit(self) -> None:
        """Write the central directory, make the file durable and put it at the path
        (replacing a checkpoint there only if ``overwrite``); the writer is then closed."""
        with self._lock:
            self._check_open()
            if _ROOT_KEY not in self._members:
                raise WriteError("nothing to commit: the save wrote no root zarr.json",
                                 rule="UCP-1.0-R074", path=self.location)
            members = [m for m, _ in sorted(self._members.values(), key=lambda e: e[1])]
            tail = zip_layout.directory(members, self._end)
            os.pwrite(self._fd, tail, self._end)
            os.ftruncate(self._fd, self._end + len(tail))
            if self.durable:
                os.fsync(self._fd)
            try:
                if self.overwrite:
                    os.replace(self._partial, self.path)
                else:  # a link fails where a file appeared meanwhile: never replaced
                    os.link(self._partial, self.path)
                    os.unlink(self._partial)
            except FileExistsError as exc:
                raise CheckpointExistsError(
                    "another writer put a file at this path during the save; nothing was "
                    "replaced", rule="UCP-1.0-R064", path=self.location) from exc
            except IsADirectoryError as exc:
                raise CheckpointExistsError(
                    "a directory appeared at this path during the save; nothing was "
                    "replaced", rule="UCP-1.0-R066", path=self.location) from exc
            except OSError as exc:  # no hard links here, a full disk, ...
                raise StorageError(
                    f"cannot put the new file at this path: {exc.strerror or exc}; nothing "
                    "was replaced (overwrite=True renames instead of linking)",
                    rule="UCP-1.0-R074", path=self.location) from exc
            if self.durable:
                _fsync_directory(self.path.parent)
            self._finalizer()

    def discard(self) -> None:
        """Remove the new file (idempotent; after a commit, nothing)."""
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise WriteError("this archive writer was committed or discarded",
                             path=self.location)

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    # -- reads of what was written ----------------------------------------------------

    def _entry(self, key: str) -> tuple[Member, int] | None:
        check_key(key)
        with self._lock:
            return self._members.get(key)

    def get(self, key: str) -> bytes | None:
        return self.get_range(key, 0, 1 << 62)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        claimed = self._claims.get(key)
        if claimed is not None:
            return claimed[offset:offset + length]
        entry = self._entry(key)
        if entry is None:
            return None
        member, start = entry
        offset = min(max(0, offset), member.size)
        return pread_all(self._fd, min(length, member.size - offset), start + offset)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        size = self.size(key)
        return None if size is None else self.get_range(key, max(0, size - length), length)

    def size(self, key: str) -> int | None:
        claimed = self._claims.get(key)
        if claimed is not None:
            return len(claimed)
        entry = self._entry(key)
        return None if entry is None else entry[0].size

    def list(self, prefix: str = "") -> Iterator[str]:
        start = f"{prefix}/" if prefix else ""
        with self._lock:
            names = [*self._members, *self._claims]
        return iter([n for n in names if n.startswith(start)])

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def __repr__(self) -> str:
        return f"ArchiveWriter({self.location!r})"


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(fd: int, path: str) -> None:
    close_quietly(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["ARCHIVE_SUFFIX", "MAX_DIRECTORY_BYTES", "PARTIAL_SUFFIX", "ArchiveStore",
           "ArchiveWriter", "check_directory_location", "has_archive_suffix",
           "is_archive_path", "writes_archive"]
