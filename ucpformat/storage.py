"""Key-value storage under a checkpoint: the only code that touches files.

Keys are ``/``-separated paths relative to the checkpoint root (``model/fc.weight/c/0/0``).
Every key is checked before use, and on a local file system every file is resolved to
its real path and must lie inside the checkpoint, so that neither a hostile name nor a
symbolic link can reach outside it (spec requirements UCP-1.0-R010 and UCP-1.0-R091).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import stat
import sys
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ucpformat.errors import (
    CheckpointNotFoundError,
    StorageError,
    UCPError,
    UnsafePathError,
)

_KEY_PART = re.compile(r"^[A-Za-z0-9._%-]+$")


def _key_part_ok(part: str) -> bool:
    """One component of a key that :func:`check_key` accepts."""
    return part not in (".", "..") and len(part) <= 255 and _KEY_PART.match(part) is not None


def check_key(key: str) -> None:
    """Refuse keys that are empty, absolute, or contain ``.``/``..``/odd characters."""
    if not isinstance(key, str) or not key:
        raise UnsafePathError(f"storage key {key!r} is empty or not a string", rule="UCP-1.0-R091")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.match(part):
            raise UnsafePathError(
                f"storage key {key!r} has an unsafe component {part!r}", rule="UCP-1.0-R091"
            )
        if len(part) > 255:  # no file system takes it (and no node name may be longer)
            raise UnsafePathError(
                f"storage key {key[:80]!r}... has a component of {len(part)} bytes; the limit "
                "is 255",
                rule="UCP-1.0-R012",
            )


class Store(ABC):
    """What a checkpoint reader and writer need from storage."""

    #: Human-readable location, used in messages.
    location: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole object, or None if it does not exist."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """``length`` bytes from ``offset``; fewer if the object is shorter; None if absent."""

    @abstractmethod
    def get_suffix(self, key: str, length: int) -> bytes | None:
        """The last ``length`` bytes (all of them if shorter), or None if absent."""

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        """Fill ``buffers`` in order from ``offset``.

        Returns the bytes read (fewer at the end of the object), or None if it is absent.
        """
        total = sum(memoryview(b).nbytes for b in buffers)
        data = self.get_range(key, offset, total)
        if data is None:
            return None
        pos = 0
        for b in buffers:
            view = memoryview(b).cast("B")
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
        return len(data)

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size in bytes, or None if absent."""

    @abstractmethod
    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        """Write an object from buffers, in order; returns the byte count.

        ``atomic``: a concurrent reader sees the old object or the new one, never a part.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object if it exists (durably, before returning)."""

    def delete_keys(self, keys: Iterable[str]) -> None:
        """Delete objects that may exist; durable once :meth:`flush` returns."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def delete_all(self) -> None:
        """Delete every object of this store (the whole checkpoint)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """All keys under ``prefix`` (recursively), in no particular order."""

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        """The keys :meth:`list` gives, in its order, each with the size :meth:`size`
        would return where the listing tells it without another request; None where it
        does not (ask :meth:`size`, which also makes that key's checks). This default
        tells none."""
        for key in self.list(prefix):
            yield key, None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def flush(self) -> None:  # noqa: B027 - a no-op is the right default
        """Make everything written so far durable."""

    def is_empty(self) -> bool:
        return next(iter(self.list()), None) is None


class LocalStore(Store):
    """A checkpoint directory on a local (or POSIX network) file system.

    Durability (``durable=True``) is batched: a non-atomic :meth:`put` starts the
    write-back of its file to the disk (``sync_file_range``, where Linux has it) and
    returns; :meth:`flush` then fsyncs every file written since the last flush, and
    every directory that gained an entry, many at a time, and returns when all of them
    are durable. The disk thus writes one file while the next is being encoded, and
    fsyncs share journal commits instead of paying one each; what a commit needs
    (UCP-1.0-R050: everything durable before the root is written) holds because the
    writer calls :meth:`flush` before it writes the root. An atomic put (the commit
    marker, the root) is made durable before it returns, its directory too.
    """

    #: Files and directories fsynced at the same time by :meth:`flush`.
    SYNC_THREADS = 16

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root).absolute()
        self.location = str(self.root)
        self.durable = durable
        self._dirty_dirs: set[str] = set()
        self._unsynced: list[str] = []
        self._made_dirs: set[str] = set()
        # key -> (path, device, inode) of the file its path check found (reads of a
        # committed, immutable checkpoint repeat keys: one realpath per key, not one per
        # chunk; a file replaced since, e.g. by a link, is checked again: see _open)
        self._readable: dict[str, tuple[str, int, int]] = {}
        self._lock = threading.Lock()

    # -- paths ------------------------------------------------------------------------

    def _path(self, key: str, *, for_read: bool) -> str:
        check_key(key)
        path = os.path.join(self.location, *key.split("/"))
        if for_read and os.path.lexists(path):
            real = os.path.realpath(path)
            root_real = os.path.realpath(self.location)
            if not (real == root_real or real.startswith(root_real + os.sep)):
                raise UnsafePathError(
                    f"{key!r} resolves to {real}, outside the checkpoint", rule="UCP-1.0-R091",
                    path=self.location,
                )
            if not os.path.isfile(real):
                raise UnsafePathError(
                    f"{key!r} is not a regular file", rule="UCP-1.0-R091", path=self.location
                )
            try:
                st = os.stat(real)
            except FileNotFoundError:
                return path
            if len(self._readable) >= 1 << 16:
                self._readable.clear()
            self._readable[key] = (path, st.st_dev, st.st_ino)
        return path

    def _forget(self, key: str) -> None:
        self._readable.pop(key, None)

    def _open(self, key: str) -> int | None:
        """A descriptor of the object's file, or None if it is absent. A key's path is
        checked (UCP-1.0-R091) on its first read; later reads reuse the check while the
        file opened is the one it found (same device and inode): a path whose file was
        replaced since (by a link out of the checkpoint, say) is checked again."""
        known = self._readable.get(key)
        path = known[0] if known is not None else self._path(key, for_read=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        if known is not None:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != known[1:]:
                os.close(fd)
                self._forget(key)
                return self._open(key)
        return fd

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        with open(fd, "rb") as f:
            return f.read()

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            # Never allocate for more than the file holds: a hostile shard index may ask
            # for 2**60 bytes (UCP-1.0-R094).
            length = max(0, min(length, os.fstat(fd).st_size - offset))
            return _pread_all(fd, length, offset)
        finally:
            os.close(fd)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - length)
            return _pread_all(fd, size - start, start)
        finally:
            os.close(fd)

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
            total = 0
            while views:
                n = os.preadv(fd, views[:1024], offset + total)
                if n == 0:
                    break
                total += n
                _advance(views, n)
            return total
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        known = self._readable.get(key)
        path = known[0] if known is not None else self._path(key, for_read=True)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if known is not None and (st.st_dev, st.st_ino) != known[1:]:
            self._forget(key)  # replaced since its check: check it again
            return self.size(key)
        return st.st_size

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.location if not prefix else os.path.join(self.location, *prefix.split("/"))
        if not os.path.isdir(base):
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            rel = os.path.relpath(dirpath, self.location)
            for name in sorted(filenames):
                yield name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        """:meth:`list`'s walk, and the size of every regular file it reaches through
        directories that are no links and whose key :func:`check_key` accepts: what
        :meth:`size` returns for it (its real path lies inside the checkpoint), at the cost
        of one ``lstat`` instead of a path resolution per key. Links and other files get
        None, and so does every key of a subclass that overrides :meth:`size`."""
        base = self.location if not prefix else os.path.join(self.location, *prefix.split("/"))
        if not os.path.isdir(base):
            return
        rel = os.path.relpath(base, self.location)
        root_real = os.path.realpath(self.location)
        exact = type(self).size is LocalStore.size and os.path.realpath(base) == (
            root_real if rel == "." else os.path.join(root_real, rel))
        key_ok = exact and (rel == "." or all(_key_part_ok(p) for p in rel.split(os.sep)))
        # os.walk(base)'s order and choices: top-down, directories sorted, links to
        # directories not followed, a directory that cannot be read skipped
        stack = [(base, "" if rel == "." else rel.replace(os.sep, "/") + "/", key_ok)]
        while stack:
            directory, key_prefix, dir_ok = stack.pop()
            dirs: list[os.DirEntry[str]] = []
            files: list[os.DirEntry[str]] = []
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        try:
                            is_dir = entry.is_dir()
                        except OSError:
                            is_dir = False
                        (dirs if is_dir else files).append(entry)
            except OSError:
                continue
            for entry in sorted(files, key=lambda e: e.name):
                size = None
                if dir_ok and _key_part_ok(entry.name):
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        size = st.st_size if stat.S_ISREG(st.st_mode) else None
                yield key_prefix + entry.name, size
            for entry in sorted(dirs, key=lambda e: e.name, reverse=True):
                if not os.path.islink(entry.path):
                    stack.append((entry.path, f"{key_prefix}{entry.name}/",
                                  dir_ok and _key_part_ok(entry.name)))

    # -- writes -----------------------------------------------------------------------

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        path = self._path(key, for_read=False)
        self._forget(key)
        directory = os.path.dirname(path)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        target = f"{path}.tmp-{uuid.uuid4().hex}" if atomic else path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(target, flags, 0o644)
        except FileNotFoundError:
            # a directory made earlier was removed since (the location deleted and saved
            # to again through this store): make it again
            self._made_dirs.discard(directory)
            os.makedirs(directory, exist_ok=True)
            fd = os.open(target, flags, 0o644)
        try:
            try:
                written = _write_all(fd, buffers)
                if self.durable:
                    if atomic:
                        os.fsync(fd)
                    else:
                        start_writeback(fd)
            finally:
                os.close(fd)
            if atomic:
                os.replace(target, path)
        except BaseException:
            if atomic:  # leave no temporary file behind (it would be a foreign file)
                with contextlib.suppress(OSError):
                    os.unlink(target)
            raise
        if atomic:
            if self.durable:
                _fsync_dir(directory)
        else:
            with self._lock:
                self._dirty_dirs.add(directory)
                if self.durable:
                    self._unsynced.append(path)
        return written

    def delete(self, key: str) -> None:
        directory = self._unlink(key)
        if directory is not None and self.durable:
            _fsync_dir(directory)

    def delete_keys(self, keys: Iterable[str]) -> None:
        for key in keys:
            directory = self._unlink(key)
            if directory is not None:
                with self._lock:
                    self._dirty_dirs.add(directory)

    def _unlink(self, key: str) -> str | None:
        """Remove the file of ``key``; its directory, or None if there was no file."""
        path = self._path(key, for_read=False)
        self._forget(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return os.path.dirname(path)

    def delete_all(self) -> None:
        self._readable.clear()
        self._made_dirs.clear()
        if not os.path.isdir(self.location):
            return
        for entry in os.listdir(self.location):
            full = os.path.join(self.location, entry)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        if self.durable:
            _fsync_dir(self.location)

    def flush(self) -> None:
        """Make every file written and every entry added or removed so far durable."""
        if not self.durable:
            with self._lock:
                self._dirty_dirs.clear()
            return
        with self._lock:
            files, self._unsynced = self._unsynced, []
            dirty, self._dirty_dirs = self._dirty_dirs, set()
        # Each directory that gained or lost an entry, and every directory up to the root
        # (a new directory is itself an entry of its parent), once each.
        dirs: set[str] = set()
        for directory in dirty:
            while directory not in dirs:
                dirs.add(directory)
                if directory == self.location or not directory.startswith(self.location):
                    break
                directory = os.path.dirname(directory)
        _parallel(_fsync_file, files, self.SYNC_THREADS)
        _parallel(_fsync_dir, sorted(dirs), self.SYNC_THREADS)


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    chunks = []
    remaining = length
    while remaining > 0:
        data = os.pread(fd, remaining, offset)
        if not data:
            break
        chunks.append(data)
        offset += len(data)
        remaining -= len(data)
    return b"".join(chunks)


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of views (after a partial readv/writev)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _write_all(fd: int, buffers: Sequence[Any]) -> int:
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(v) for v in views)
    while views:
        _advance(views, os.writev(fd, views[:1024]))
    return total


def _parallel(fn: Callable[[str], None], paths: Sequence[str], threads: int) -> None:
    if len(paths) <= 1 or threads <= 1:
        for p in paths:
            fn(p)
        return
    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="ucp-fsync") as pool:
        for _ in pool.map(fn, paths):
            pass


def _fsync_file(path: str) -> None:
    """fsync a file written earlier (through another descriptor: Linux flushes the file's
    pages whichever descriptor wrote them); a file since deleted needs nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range() -> Callable[[int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait

    def start(fd: int) -> None:
        fn(fd, 0, 0, write)  # a hint: a failure shows at the fsync, which is what counts

    return start


_SYNC_FILE_RANGE = _load_sync_file_range()


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages to the disk now, without
    waiting (Linux ``sync_file_range``; elsewhere nothing): the later fsync then has
    little left to do, and the disk works while the writer encodes the next file."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_store(
    location: str | os.PathLike[str] | Store,
    *,
    durable: bool = True,
    storage_options: Any = None,
) -> Store:
    """A Store for a path or URL (or an existing Store, returned as is).

    A URL such as ``s3://bucket/prefix`` (any protocol fsspec knows, with its package
    installed: s3fs for S3) gives an :class:`~ucpformat.storage_fsspec.FsspecStore`;
    ``storage_options`` go to fsspec (credentials, ``client_kwargs``, ...).
    """
    if isinstance(location, Store):
        return location
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        from ucpformat.storage_fsspec import FsspecStore

        return FsspecStore(text, storage_options=storage_options)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStore(text, durable=durable)


class ReadGuard(Store):
    """The reads of another store, with every failure of the operating system (permission
    denied, a file where a directory should be, a name too long, an I/O error) raised as a
    :class:`~ucpformat.errors.StorageError` that names the file (UCP-1.0-R099).

    ``open`` and ``validate`` read through it, so that no public read call lets a raw
    ``OSError`` escape; writes pass through unchanged (the writer reports its own).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.location = inner.location

    def _error(self, key: str, exc: OSError) -> UCPError:
        if isinstance(exc, NotADirectoryError) and key.count("/") == 0:
            return CheckpointNotFoundError(
                "not a directory: a checkpoint is a directory", rule="UCP-1.0-R051",
                path=self.location,
            )
        reason = exc.strerror or str(exc) or type(exc).__name__
        where = self.location if key in ("", ".") else f"{self.location}/{key}"
        return StorageError(f"cannot read it: {reason}", rule="UCP-1.0-R099", path=where)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except UCPError:
            raise
        except OSError as exc:
            raise self._error(key, exc) from exc

    def get(self, key: str) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get(key))
        return result

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get_range(key, offset, length))
        return result

    def get_suffix(self, key: str, length: int) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get_suffix(key, length))
        return result

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        result: int | None = self._call(key, lambda: self.inner.read_into(key, offset, buffers))
        return result

    def size(self, key: str) -> int | None:
        result: int | None = self._call(key, lambda: self.inner.size(key))
        return result

    def exists(self, key: str) -> bool:
        return bool(self._call(key, lambda: self.inner.exists(key)))

    def list(self, prefix: str = "") -> Iterator[str]:
        keys = iter(self._call(prefix or ".", lambda: self.inner.list(prefix)))
        while True:
            try:
                key = next(keys)
            except StopIteration:
                return
            except UCPError:
                raise
            except OSError as exc:
                raise self._error(prefix or ".", exc) from exc
            yield key

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        found = iter(self._call(prefix or ".", lambda: self.inner.list_sizes(prefix)))
        while True:
            try:
                item = next(found)
            except StopIteration:
                return
            except UCPError:
                raise
            except OSError as exc:
                raise self._error(prefix or ".", exc) from exc
            yield item

    def is_empty(self) -> bool:
        return bool(self._call(".", self.inner.is_empty))

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        return self.inner.put(key, buffers, atomic=atomic)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_keys(self, keys: Iterable[str]) -> None:
        self.inner.delete_keys(keys)

    def delete_all(self) -> None:
        self.inner.delete_all()

    def flush(self) -> None:
        self.inner.flush()


def read_guarded(location: str | os.PathLike[str] | Store) -> Store:
    """The store of a location for reading (``durable=False``), behind a :class:`ReadGuard`."""
    if not isinstance(location, Store) and "\x00" in os.fspath(location):
        raise StorageError("a location cannot contain a NUL character", rule="UCP-1.0-R099",
                           path=repr(os.fspath(location)))
    store = open_store(location, durable=False)
    return store if isinstance(store, ReadGuard) else ReadGuard(store)
