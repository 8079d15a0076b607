"""A checkpoint directory on a local (or POSIX network) file system (:class:`LocalStore`).

Keys are ``/``-separated paths relative to the checkpoint root (``model/fc.weight/c/0/0``).
Every key is checked before use (UCP-1.0-R091). On a file system, nothing under the
location is ever reached through a symbolic link (UCP-1.0-R089): every directory and file
is opened relative to the location's descriptor without following links (Linux's
``openat2`` with ``RESOLVE_NO_SYMLINKS``, else one component at a time with
``O_NOFOLLOW``), and a file read is checked on its descriptor (``fstat``), not on its
path, so that a link planted between a check and an open is never followed. Writes
create new files (a file already there is replaced, never written through: it may be a
hard link). The system calls themselves are in :mod:`ucpformat.store.posix`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ucpformat.errors import (
    ConcurrentWriteError,
    UnsafePathError,
)
from ucpformat.store import posix
from ucpformat.store.base import Store, StoreClaim, check_key, is_safe_key_part
from ucpformat.store.posix import (
    CLAIM_FLAGS,
    CREATE_FLAGS,
    FSYNC_FLAGS,
    READ_FLAGS,
    is_dir,
    is_link,
    parallel,
    pread_all,
    same_file,
    start_writeback,
    try_lock,
    walk,
)


class _HeldLocation:
    """A :meth:`LocalStore.batch`: the location's descriptor (-1 until a call needs it),
    the identity of the directory it names, the holds and the calls using it, and the
    keys of the directories made or met under it (hints for where a walk starts)."""

    def __init__(self) -> None:
        self.fd = -1
        self.identity: tuple[int, int] | None = None
        self.holds = 0
        self.users = 0
        self.dirs: set[str] = set()


class _Reading:
    """:meth:`LocalStore._reading`'s block (a class, not a generator: a third of the
    cost, once per object read)."""

    __slots__ = ("opened",)

    def __init__(self, opened: tuple[int, int] | None) -> None:
        self.opened = opened

    def __enter__(self) -> tuple[int, int] | None:
        return self.opened

    def __exit__(self, *exc: object) -> None:
        if self.opened is not None:
            os.close(self.opened[0])


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

    Nothing under the location is reached through a symbolic link (UCP-1.0-R089): each
    path is opened from the location's descriptor in one ``openat2`` call that refuses
    any link on the way (Linux 5.6+), or else component by component with
    ``O_NOFOLLOW``, so a link met on the way is refused, whenever it was planted. The
    location itself may be a link (it is the caller's path) unless ``follow_link=False``.
    """

    #: Files and directories fsynced at the same time by :meth:`flush`.
    SYNC_THREADS = 16

    atomic_create = True

    def __init__(
        self, root: str | os.PathLike[str], *, durable: bool = True, follow_link: bool = True
    ) -> None:
        self.root = Path(root).absolute()
        self.location = str(self.root)
        self.durable = durable
        self.follow_link = follow_link
        self._dirty_dirs: set[str] = set()  # keys of directories ("" is the location)
        self._unsynced: list[str] = []  # keys of files written since the last flush
        self._lock = threading.Lock()
        self._held: _HeldLocation | None = None  # while a batch() lasts

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a writer process): the location and settings, nothing held."""
        state = dict(self.__dict__)
        state.update(_dirty_dirs=set(), _unsynced=[], _lock=None, _held=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- paths ------------------------------------------------------------------------

    def _open_location(self, *, create: bool) -> int:
        """A descriptor of the location's directory (made, with its parents, if asked)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if not self.follow_link:
            flags |= os.O_NOFOLLOW
        try:
            return os.open(self.location, flags)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.location, exist_ok=True)
            return os.open(self.location, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (
                exc.errno == errno.ENOTDIR and not self.follow_link
                and os.path.islink(self.location)
            ):
                raise UnsafePathError(
                    "the checkpoint location is a symbolic link, which this store does not "
                    "follow", rule="UCP-1.0-R089", path=self.location,
                ) from exc
            raise

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the location for a batch of calls: one descriptor of its directory, opened
        at the first call that needs it, serves every call of every thread until the
        last batch ends (each call opened and closed its own: two system calls, each
        releasing the GIL that the other writer threads wait for), and the directories
        made or met meanwhile are remembered, so that a new directory is made from the
        deepest one known instead of from the location. Batches nest.

        What is written in a batch goes to the directory that was opened, whatever is at
        the location's path since (a removed location is not made again); an atomic write
        (a commit) checks that the path still names that directory, and raises
        :class:`~ucpformat.errors.ConcurrentWriteError` (UCP-1.0-R059) if it does not. A
        save is one batch from before its claim to its end, so that all of it goes to the
        directory it claimed. The end of a batch checks nothing: once the root is
        written, the checkpoint may be moved (a save to a temporary path, then renamed)
        while other ranks are still leaving theirs. The descriptor is closed once the
        last batch has ended and no call uses it any more (never while one does: its
        number could name another file by then)."""
        with self._lock:
            held = self._held
            if held is None:
                held = self._held = _HeldLocation()
            held.holds += 1
        try:
            yield
        finally:
            with self._lock:
                held.holds -= 1
                last = held.holds == 0
                if last:
                    self._held = None  # calls from now on open their own descriptor
                fd = held.fd if last and held.users == 0 else -1
                if fd >= 0:
                    held.fd = -1
            if fd >= 0:
                os.close(fd)

    def _acquire_location(self, *, create: bool) -> tuple[int, _HeldLocation | None]:
        """A descriptor of the location and the hold it belongs to (None: the caller's own
        descriptor); give it back with :meth:`_release_location`."""
        held = self._held
        if held is not None:
            with self._lock:
                if self._held is held:
                    if held.fd < 0:  # the first call of the hold that needs it
                        fd = self._open_location(create=create)
                        try:
                            st = os.fstat(fd)
                        except BaseException:
                            os.close(fd)
                            raise
                        held.fd, held.identity = fd, (st.st_dev, st.st_ino)
                    held.users += 1
                    return held.fd, held
        return self._open_location(create=create), None

    def _release_location(self, fd: int, held: _HeldLocation | None) -> None:
        if held is not None:
            with self._lock:
                held.users -= 1
                if held.holds or held.users:
                    return
                held.fd = -1  # the holds ended while this call was using it
        os.close(fd)

    def _own_location(self) -> int:
        """A descriptor of the location of the caller's own, to close after use: a new
        open file description (a directory's listing position is one, and must not be
        shared between threads), of the held directory while a hold lasts."""
        location, held = self._acquire_location(create=False)
        if held is None:
            return location
        try:
            return os.open(".", posix.DIR_FLAGS, dir_fd=location)
        finally:
            self._release_location(location, held)

    def _check_held(self, held: _HeldLocation | None = None) -> None:
        """Raise ConcurrentWriteError if the location's path no longer names the directory
        that the hold (default: the current one, if any) opened."""
        held = held if held is not None else self._held
        if held is None or held.identity is None:
            return
        try:
            st = os.stat(self.location, follow_symlinks=self.follow_link)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != held.identity:
            raise ConcurrentWriteError(
                "the checkpoint location was removed or replaced while this save was writing "
                "there: what it wrote went to the directory it had opened, not to the one "
                "now at this path", rule="UCP-1.0-R059", path=self.location,
            )

    @contextlib.contextmanager
    def _directory(self, key: str, *, create: bool, missed: bool = False
                   ) -> Iterator[tuple[int, str]]:
        """``(descriptor of the key's directory, the key's last component)``.

        Every directory on the way is opened relative to its parent without following a
        link (made if ``create``). Raises FileNotFoundError if one is missing (or is a
        file), UnsafePathError if one is a link. ``missed``: the caller's one-call open of
        the key (:meth:`_open_beneath`) has just failed, so its directory is not tried
        whole again.
        """
        check_key(key)
        parts = key.split("/")
        location, held = self._acquire_location(create=create)
        fd = location  # the directory reached so far (each one closed once left)
        try:
            fd, start = self._walk_start(location, parts, held, missed)
            # made first, then opened: the directory below the last one made here (new
            # too), and the first one walked after a missed one-call open (new, likely)
            made = create and missed
            for i in range(start, len(parts) - 1):
                part = parts[i]
                if made:
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        made = False
                    nxt = self._open_dir(fd, parts, i)
                else:
                    try:
                        nxt = os.open(part, posix.DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise
                        try:
                            os.mkdir(part, 0o777, dir_fd=fd)
                            made = True
                        except FileExistsError:
                            pass
                        nxt = self._open_dir(fd, parts, i)
                    except OSError as exc:
                        nxt = self._refuse_dir(exc, fd, parts, i)
                if fd != location:
                    os.close(fd)
                fd = nxt
                if held is not None:
                    held.dirs.add("/".join(parts[: i + 1]))
            yield fd, parts[-1]
        finally:
            if fd != location:
                os.close(fd)
            self._release_location(location, held)

    def _walk_start(self, location: int, parts: Sequence[str], held: _HeldLocation | None,
                    missed: bool) -> tuple[int, int]:
        """Where :meth:`_directory`'s walk of ``parts`` starts: ``(descriptor, index of the
        first part to walk)``. One ``openat2`` (refusing any link on the way) of the whole
        directory path, unless ``missed``; else of the deepest directory on the way that
        this hold made or met; else the location itself (index 0), from which the walk
        makes what is missing and says precisely what was refused."""
        if len(parts) < 2 or posix.OPENAT2 is None:
            return location, 0
        tries = [] if missed else [len(parts) - 1]
        if held is not None:
            known = next((i for i in range(len(parts) - 1, 0, -1)
                          if "/".join(parts[:i]) in held.dirs), None)
            if known is not None and known not in tries:
                tries.append(known)
        for i in tries:
            try:
                return posix.OPENAT2(location, "/".join(parts[:i]), posix.DIR_FLAGS), i
            except OSError:
                continue
        return location, 0

    def _open_beneath(self, key: str, flags: int, mode: int = 0) -> int | None:
        """The file of ``key`` opened in one system call (``openat2`` from the location,
        refusing any link on the way), or None where that is not available or failed:
        the caller then takes :meth:`_directory`'s walk, which makes what is missing and
        says precisely what was refused. Each system call saved matters: each one
        releases and retakes the GIL that the other writer threads wait for."""
        if posix.OPENAT2 is None or "/" not in key:
            return None
        check_key(key)
        try:
            location, held = self._acquire_location(create=False)
        except OSError:
            return None
        try:
            fd = posix.OPENAT2(location, key, flags, mode)
        except OSError:
            return None
        finally:
            self._release_location(location, held)
        if held is not None:
            held.dirs.add(key.rpartition("/")[0])
        return fd

    def _open_dir(self, parent: int, parts: Sequence[str], i: int) -> int:
        try:
            return os.open(parts[i], posix.DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            return self._refuse_dir(exc, parent, parts, i)

    def _refuse_dir(self, exc: OSError, parent: int, parts: Sequence[str], i: int) -> int:
        """Raise the right error for a directory component that could not be opened."""
        if exc.errno == errno.ENOTDIR:
            if is_link(parent, parts[i]):
                self._refuse_link(parent, parts[: i + 1], "/".join(parts))
            raise exc  # a file where a directory is expected (a read error: UCP-1.0-R099)
        if exc.errno == errno.ELOOP:
            self._refuse_link(parent, parts[: i + 1], "/".join(parts))
        raise exc

    def _refuse_link(self, parent: int, parts: Sequence[str], key: str) -> None:
        """Raise UnsafePathError for ``key``, whose part ``parts`` is a link (UCP-1.0-R091 if it
        points outside the checkpoint, else UCP-1.0-R089)."""
        link = "/".join(parts)
        what = f"{key!r} is" if link == key else f"{key!r}: its directory {link!r} is"
        try:
            target = os.readlink(parts[-1], dir_fd=parent)
        except OSError:
            target = "?"
        if target.startswith("/"):  # inside if it names a path under the location
            bases = {self.location, os.path.realpath(self.location)}
            target_in = posixpath.normpath(target)
            inside = any(target_in.startswith(b.rstrip("/") + "/") for b in bases)
        else:
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
            inside = not (resolved == ".." or resolved.startswith("../"))
        if not inside:
            raise UnsafePathError(
                f"{what} a symbolic link to {target!r}, outside the checkpoint",
                rule="UCP-1.0-R091", path=self.location,
            )
        raise UnsafePathError(
            f"{what} a symbolic link (to {target!r}); a checkpoint holds no links, and none "
            "is followed", rule="UCP-1.0-R089", path=self.location,
        )

    # -- reads ------------------------------------------------------------------------

    def _open(self, key: str) -> tuple[int, int] | None:
        """A descriptor of the object's regular file and its size, or None if it is absent.

        Opened without following a link at any component, and checked on the descriptor
        (UCP-1.0-R089): what was opened is what is read, whatever replaced the path since.
        The size is that of the check's ``fstat``: reads bound themselves by it instead of
        asking again (a system call each).
        """
        fd_fast = self._open_beneath(key, READ_FLAGS)
        try:
            if fd_fast is not None:
                fd = fd_fast
            else:
                with self._directory(key, create=False) as (parent, leaf):
                    try:
                        fd = os.open(leaf, READ_FLAGS, dir_fd=parent)
                    except OSError as exc:
                        if exc.errno == errno.ELOOP:
                            self._refuse_link(parent, key.split("/"), key)
                        raise
        except FileNotFoundError:
            return None  # (a file where a directory is expected is an error: UCP-1.0-R099)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePathError(f"{key!r} is not a regular file", rule="UCP-1.0-R091",
                                  path=self.location)
        return fd, st.st_size

    def _reading(self, key: str) -> _Reading:
        """The object's file opened as :meth:`_open` opens it, with its size (None:
        absent), closed when the block ends."""
        return _Reading(self._open(key))

    def get(self, key: str) -> bytes | None:
        with self._reading(key) as opened:
            return None if opened is None else pread_all(opened[0], opened[1], 0)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        with self._reading(key) as opened:
            if opened is None:
                return None
            fd, size = opened
            # Never allocate for more than the file holds: a hostile shard index may ask
            # for 2**60 bytes (UCP-1.0-R094).
            return pread_all(fd, max(0, min(length, size - offset)), offset)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        with self._reading(key) as opened:
            if opened is None:
                return None
            fd, size = opened
            start = max(0, size - length)
            return pread_all(fd, size - start, start)

    def get_suffix_and_size(self, key: str, length: int) -> tuple[bytes, int | None] | None:
        if type(self) is not LocalStore:  # a subclass that overrides reads sees each call
            return super().get_suffix_and_size(key, length)
        with self._reading(key) as opened:
            if opened is None:
                return None
            fd, size = opened
            start = max(0, size - length)
            return pread_all(fd, size - start, start), size

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        """:meth:`Store.read_into`, up to the end the file had when it was opened: one
        ``preadv`` of the buffers as they are, unless it stopped short of both that end
        and the buffers' end (then read on, the buffers' bytes counted)."""
        with self._reading(key) as opened:
            if opened is None:
                return None
            fd, size = opened
            return posix.preadv_until(fd, buffers, offset, size)

    def map_copy_on_write(self, key: str, size: int, *, view_only: bool = False
                          ) -> Any | None:
        """The object's file mapped privately (``MAP_PRIVATE``), opened and checked as
        every read opens it (UCP-1.0-R089), if it holds exactly ``size`` bytes. A
        mapping sees the file as it is when its pages are read: it relies on a committed
        checkpoint's files never being changed in place (UCP-1.0-R053; a file truncated
        under a mapping faults the process that reads the lost pages). A subclass that
        overrides reads gets None (its reads must see every access), and so does
        ``view_only`` (every mapping here is one of its own)."""
        if type(self) is not LocalStore or view_only:
            return None
        with self._reading(key) as opened:
            if opened is None or opened[1] != size:
                return None
            return posix.map_private(opened[0], size)

    def size(self, key: str) -> int | None:
        try:
            with self._directory(key, create=False) as (parent, leaf):
                st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    self._refuse_link(parent, key.split("/"), key)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{key!r} is not a regular file", rule="UCP-1.0-R091",
                                  path=self.location)
        return st.st_size

    def list(self, prefix: str = "") -> Iterator[str]:
        """Every entry that is not a directory, as a key: links (never followed) and
        entries whose names :func:`check_key` refuses included."""
        for key, _ in self._listing(prefix, sized=False):
            yield key

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        """:meth:`list`'s walk, and the size of every regular file whose key
        :func:`check_key` accepts: what :meth:`size` returns for it, from one ``lstat``
        relative to its directory's descriptor instead of a walk from the location per
        key. Links and other files get None, and so does every key of a subclass that
        overrides :meth:`size`."""
        return self._listing(prefix, sized=type(self).size is LocalStore.size)

    def _listing(self, prefix: str, *, sized: bool) -> Iterator[tuple[str, int | None]]:
        try:
            fd = self._own_location()
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            for part in prefix.split("/") if prefix else ():
                try:
                    nxt = os.open(part, posix.DIR_FLAGS, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError, OSError) as exc:
                    if exc.errno == errno.ELOOP or is_link(fd, part):
                        yield prefix, None  # the prefix itself is a link: not followed
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        return
                    raise
                os.close(fd)
                fd = nxt
            ok = sized and all(is_safe_key_part(p) for p in prefix.split("/")) if prefix else sized
            yield from walk(fd, f"{prefix}/" if prefix else "", ok)
        finally:
            os.close(fd)

    # -- writes -----------------------------------------------------------------------

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        return self._write(key, buffers, atomic=atomic, exclusive=False)

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        return self._write(key, buffers, atomic=atomic, exclusive=True)

    def _write(self, key: str, buffers: Sequence[Any], *, atomic: bool, exclusive: bool) -> int:
        dir_key = key.rpartition("/")[0]
        fd = None if atomic else self._open_beneath(key, CREATE_FLAGS, 0o644)
        if fd is not None:  # a new file in a directory that is there: the common case
            try:
                written = self._write_new(fd, buffers)
            except BaseException:
                with contextlib.suppress(OSError):
                    self._unlink(key)
                raise
        else:
            if atomic:  # a commit marker, the root: never where the path no longer leads
                self._check_held()
            written = self._write_walked(key, buffers, atomic=atomic, exclusive=exclusive,
                                         missed=not atomic and posix.OPENAT2 is not None)
            if atomic:
                return written
        with self._lock:
            self._dirty_dirs.add(dir_key)
            if self.durable:
                self._unsynced.append(key)
        return written

    def _write_new(self, fd: int, buffers: Sequence[Any]) -> int:
        """Write ``buffers`` to the new file ``fd``, start its write-back, close it."""
        try:
            written = posix.write_all(fd, buffers)
            if self.durable:
                start_writeback(fd)
        finally:
            os.close(fd)
        return written

    def _write_walked(self, key: str, buffers: Sequence[Any], *, atomic: bool,
                      exclusive: bool, missed: bool = False) -> int:
        with self._directory(key, create=True, missed=missed) as (parent, leaf):
            if atomic:
                written = self._write_atomic(parent, leaf, buffers, exclusive=exclusive)
                if self.durable:
                    os.fsync(parent)
                return written
            try:
                fd = os.open(leaf, CREATE_FLAGS, 0o644, dir_fd=parent)
            except FileExistsError:
                if exclusive:
                    raise
                # replace the entry, never write through it: it may be a link (hard or
                # symbolic) to a file outside the checkpoint
                os.unlink(leaf, dir_fd=parent)
                fd = os.open(leaf, CREATE_FLAGS, 0o644, dir_fd=parent)
            try:
                return self._write_new(fd, buffers)
            except BaseException:  # leave no partial file (a full disk stays full otherwise)
                with contextlib.suppress(OSError):
                    os.unlink(leaf, dir_fd=parent)
                raise

    def _write_atomic(self, parent: int, leaf: str, buffers: Sequence[Any], *,
                      exclusive: bool) -> int:
        """A temporary file beside ``leaf``, made durable, then renamed (or, if
        ``exclusive``, hard-linked: that fails if ``leaf`` exists) onto it."""
        tmp = f"{leaf}.tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=parent)
        try:
            try:
                written = posix.write_all(fd, buffers)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                os.link(tmp, leaf, src_dir_fd=parent, dst_dir_fd=parent,
                        follow_symlinks=False)
            else:
                os.rename(tmp, leaf, src_dir_fd=parent, dst_dir_fd=parent)
        finally:  # leave no temporary file behind (it would be a foreign file)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)
        return written

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        """The marker ``key``, created and locked (``flock``) for as long as the claim is
        held: a second writer finds it locked and gets BlockingIOError, even with
        ``take_over``. The marker of a writer that stopped is unlocked: it is replaced by a
        new, locked file renamed over it (never rewritten in place: it may be a link), or,
        if ``keep``, locked as it is. Where the file system has no locks, the rules of
        :meth:`Store.claim` apply."""
        with self._directory(key, create=True) as (parent, leaf):
            while True:
                try:
                    fd = os.open(leaf, CLAIM_FLAGS, 0o644, dir_fd=parent)
                except FileExistsError:
                    pass
                else:  # ours: lock it, unless another writer found it first (then theirs)
                    locked = try_lock(fd)
                    if locked is False:
                        os.close(fd)
                        raise BlockingIOError(errno.EWOULDBLOCK, "another writer holds the "
                                              "location", key) from None
                    if locked and not same_file(fd, parent, leaf):
                        os.close(fd)
                        continue
                    try:
                        posix.write_all(fd, [body])
                        if self.durable:
                            os.fsync(fd)
                            os.fsync(parent)
                    except BaseException:  # a full disk, say: leave no empty marker
                        os.close(fd)
                        with contextlib.suppress(OSError):
                            os.unlink(leaf, dir_fd=parent)
                        raise
                    if locked:
                        return StoreClaim(key, lock_fd=fd)
                    os.close(fd)
                    return StoreClaim(key)
                try:  # a marker is there: is its writer still running (holding its lock)?
                    fd = os.open(leaf, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                 dir_fd=parent)
                except FileNotFoundError:
                    continue  # removed meanwhile: create it
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a FIFO: nobody's lock
                        return self._replace_marker(parent, leaf, key, body, take_over=True)
                    if exc.errno == errno.EACCES:  # not ours to lock: cannot tell
                        return self._replace_marker(parent, leaf, key, body,
                                                    take_over=take_over)
                    raise
                try:
                    locked = try_lock(fd)
                    if locked is False:
                        raise BlockingIOError(errno.EWOULDBLOCK, "another writer holds the "
                                              "location", key)
                    if locked and not same_file(fd, parent, leaf):
                        continue  # replaced between our open and our lock: look again
                    # its writer has stopped (the lock is free): take over; without locks,
                    # only if asked to. The old lock is held until the new marker is in.
                    if keep and (locked or take_over):
                        claim = StoreClaim(key, lock_fd=fd if locked else None,
                                           took_over=True)
                        fd = -1 if locked else fd  # the claim holds it now
                        return claim
                    return self._replace_marker(parent, leaf, key, body,
                                                take_over=take_over or bool(locked))
                finally:
                    if fd >= 0:
                        os.close(fd)

    def _replace_marker(self, parent: int, leaf: str, key: str, body: bytes, *,
                        take_over: bool) -> StoreClaim:
        """A new marker file, locked where locks exist, renamed over the old one."""
        if not take_over:
            raise FileExistsError(errno.EEXIST, "a marker is there", key)
        tmp = f"{leaf}.tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, CLAIM_FLAGS, 0o644, dir_fd=parent)
        try:
            locked = try_lock(fd)
            posix.write_all(fd, [body])
            if self.durable:
                os.fsync(fd)
            os.rename(tmp, leaf, src_dir_fd=parent, dst_dir_fd=parent)
            if self.durable:
                os.fsync(parent)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        if locked:
            return StoreClaim(key, lock_fd=fd, took_over=True)
        os.close(fd)
        return StoreClaim(key, took_over=True)

    def delete(self, key: str) -> None:
        directory = self._unlink(key)
        if directory is not None and self.durable:
            self._fsync_in(directory, ())

    def delete_keys(self, keys: Iterable[str]) -> None:
        for key in keys:
            directory = self._unlink(key)
            if directory is not None:
                with self._lock:
                    self._dirty_dirs.add(directory)

    def _unlink(self, key: str) -> str | None:
        """Remove the entry of ``key`` (a link is removed, never followed); the key of its
        directory, or None if there was nothing."""
        try:
            with self._directory(key, create=False) as (parent, leaf):
                os.unlink(leaf, dir_fd=parent)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return key.rpartition("/")[0]

    def delete_all(self) -> None:
        """Remove everything under the location; the location's directory itself stays.
        Nothing is followed: a link is removed. (Writers remove every other file first and
        the in-progress marker last, with this.)"""
        try:
            fd = self._own_location()
        except FileNotFoundError:
            return
        try:
            for name in sorted(os.listdir(fd)):
                if is_dir(fd, name):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

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
                if not directory:
                    break
                directory = directory.rpartition("/")[0]
        # One task per directory: its path is walked once for its files and itself (every
        # walk costs system calls, and each call releases and retakes the GIL that the
        # other fsync threads wait for).
        files_in: dict[str, list[str]] = {d: [] for d in dirs}
        for key in files:
            files_in.setdefault(key.rpartition("/")[0], []).append(key.rpartition("/")[2])
        try:  # one descriptor of the location for the whole flush, shared by its threads
            location, held = self._acquire_location(create=False)
        except (FileNotFoundError, NotADirectoryError):
            return  # removed since: nothing left to make durable
        try:
            parallel(lambda d: self._fsync_in(d, files_in[d], location=location),
                      sorted(files_in), self.SYNC_THREADS)
        finally:
            self._release_location(location, held)

    def _fsync_in(self, dir_key: str, leaves: Sequence[str], *, location: int | None = None
                  ) -> None:
        """fsync the files ``leaves`` of the directory ``dir_key``, written earlier through
        other descriptors (Linux flushes a file's pages whichever descriptor wrote them),
        then the directory itself. What was deleted since needs nothing. ``location``: a
        descriptor of the location to open the directory from (one ``openat2``)."""
        fd = -1
        if location is not None and posix.OPENAT2 is not None:
            try:  # noqa: SIM105 - no contextlib.suppress per directory of every flush
                fd = posix.OPENAT2(location, dir_key or ".", posix.DIR_FLAGS)
            except OSError:
                pass  # the walk below says what went wrong
        try:
            if fd >= 0:
                pass
            elif not dir_key:
                fd = self._own_location()
            else:
                with self._directory(f"{dir_key}/x", create=False) as (parent, _):
                    fd = os.dup(parent)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            for leaf in leaves:
                try:
                    file_fd = os.open(leaf, FSYNC_FLAGS, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    os.fsync(file_fd)
                finally:
                    os.close(file_fd)
            os.fsync(fd)
        finally:
            os.close(fd)


