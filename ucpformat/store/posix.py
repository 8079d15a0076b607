"""The system calls under :class:`~ucpformat.store.local.LocalStore`: opening without following
links (``openat2`` with ``RESOLVE_NO_SYMLINKS`` where Linux has it, ``O_NOFOLLOW`` flags
otherwise), walking a directory by descriptor, locks, full reads and writes, and the
kernel's write-back hint (UCP-1.0-R089).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap as mmap_module
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ucpformat.store.base import is_safe_key_part

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO planted in a checkpoint must not block the open (it is refused after).
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FSYNC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def is_dir(parent: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def walk(fd: int, prefix: str, sized: bool = False) -> Iterator[tuple[str, int | None]]:
    """(key, size) of every non-directory entry under the directory ``fd``, sorted, depth
    first; directories are entered without following links (a link to one is an entry).
    ``sized``: the size of each regular file whose key (``prefix`` included) :func:`check_key`
    accepts, else None, as for links, other entries and every entry when not ``sized``."""
    with os.scandir(fd) as it:
        entries = sorted(((e.name, e.is_dir(follow_symlinks=False), e) for e in it),
                         key=lambda t: t[0])
    for name, is_dir, entry in entries:
        ok = sized and is_safe_key_part(name)
        if not is_dir:
            size = None
            if ok:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    size = st.st_size if stat.S_ISREG(st.st_mode) else None
            yield prefix + name, size
            continue
        try:
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                yield prefix + name, None  # replaced by a link or a file meanwhile: an entry
                continue
            raise
        try:
            yield from walk(sub, f"{prefix}{name}/", ok)
        finally:
            os.close(sub)


def try_lock(fd: int) -> bool | None:
    """Lock ``fd`` exclusively without waiting: True, False if another holds it, None if
    this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF,
                         errno.EINVAL):
            return None
        raise
    return True


def same_file(fd: int, parent: int, leaf: str) -> bool:
    """True if ``leaf`` in ``parent`` is still the file open as ``fd``."""
    try:
        st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def pread_all(fd: int, length: int, offset: int) -> bytes:
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


#: Buffers one ``preadv`` or ``writev`` takes at most (Linux's ``IOV_MAX``).
IOV_MAX = 1024


def preadv_until(fd: int, buffers: Sequence[Any], offset: int, end: int) -> int:
    """Fill ``buffers`` in order from byte ``offset`` of ``fd``, up to byte ``end`` (the
    file's size, or the end of an archive's member): the bytes read, at most
    ``end - offset`` (bytes of the buffers past that count hold nothing of the object).
    One ``preadv`` of the buffers as they are, unless it stopped short of both ``end``
    and the buffers' end (then read on)."""
    if offset >= end:
        return 0
    total = os.preadv(fd, buffers, offset) if len(buffers) <= IOV_MAX else 0
    if offset + total < end:
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
        advance_views(views, total)
        while views and offset + total < end:
            n = os.preadv(fd, views[:IOV_MAX], offset + total)
            if n == 0:
                break
            total += n
            advance_views(views, n)
    return min(total, end - offset)


def advance_views(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of views (after a partial readv/writev)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def write_all(fd: int, buffers: Sequence[Any]) -> int:
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(v) for v in views)
    while views:
        advance_views(views, os.writev(fd, views[:IOV_MAX]))
    return total


def parallel(fn: Callable[[str], None], paths: Sequence[str], threads: int) -> None:
    if len(paths) <= 1 or threads <= 1:
        for p in paths:
            fn(p)
        return
    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="ucp-fsync") as pool:
        for _ in pool.map(fn, paths):
            pass


def _linux_libc_function(name: str) -> Any:
    """The C library's function ``name`` (errno kept), or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None


def _load_sync_file_range() -> Callable[[int], None] | None:
    fn = _linux_libc_function("sync_file_range")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait

    def start(fd: int) -> None:
        fn(fd, 0, 0, write)  # a hint: a failure shows at the fsync, which is what counts

    return start


_SYNC_FILE_RANGE = _load_sync_file_range()


def _load_openat2() -> Callable[..., int] | None:
    """Linux's ``openat2`` (5.6+) with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: a path
    opened relative to a directory descriptor in one system call, refused (ELOOP, EXDEV)
    if any component is a link or leads out. None where it is missing or not allowed."""
    syscall = _linux_libc_function("syscall")
    if syscall is None:
        return None
    syscall.restype = ctypes.c_long

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                    ("resolve", ctypes.c_uint64)]

    sys_openat2 = 437  # the same number on every architecture (added in Linux 5.6)
    resolve = 0x02 | 0x04 | 0x08  # NO_MAGICLINKS | NO_SYMLINKS | BENEATH
    size = ctypes.c_size_t(ctypes.sizeof(OpenHow))
    # the kernel only reads the struct: one per (flags, mode), shared by every thread
    hows: dict[tuple[int, int], Any] = {}

    def openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
        how = hows.get((flags, mode))
        if how is None:
            how = hows[flags, mode] = ctypes.byref(OpenHow(flags, mode, resolve))
        fd = syscall(sys_openat2, ctypes.c_int(dir_fd), os.fsencode(path), how, size)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(fd)

    root = os.open("/", DIR_FLAGS)
    try:  # a probe: ENOSYS (old kernel) or EPERM (a seccomp filter) mean unavailable
        os.close(openat2(root, ".", DIR_FLAGS))
    except OSError:
        return None
    finally:
        os.close(root)
    return openat2


OPENAT2 = _load_openat2()


def _load_mmap() -> tuple[Any, Any] | None:
    """The C library's ``mmap`` and ``munmap``, or None off Linux or without them."""
    mmap, munmap = _linux_libc_function("mmap"), _linux_libc_function("munmap")
    if mmap is None or munmap is None:
        return None
    mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_long]
    mmap.restype = ctypes.c_void_p
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap.restype = ctypes.c_int
    return mmap, munmap


_MMAP = _load_mmap()
_PROT_READ, _PROT_WRITE, _MAP_PRIVATE = mmap_module.PROT_READ, mmap_module.PROT_WRITE, \
    mmap_module.MAP_PRIVATE
_MAP_FAILED = ctypes.c_void_p(-1).value


#: Mappings of :func:`map_private` alive at once, at most: a quarter of Linux's default
#: limit of mappings per process (``vm.max_map_count``, 65,530), so that loading many
#: tensors never leaves the process (malloc, torch, thread stacks) without mappings of
#: its own; beyond it, the callers read.
MAX_MAPPINGS = 16384
_mappings = 0
_mappings_lock = threading.Lock()


def _mapped(flags: int, fd: int, length: int, offset: int = 0) -> Any | None:
    """``mmap`` of ``length`` bytes from ``offset`` (a multiple of the page size;
    ``PROT_READ | PROT_WRITE``) as a writable buffer that unmaps itself once nothing
    refers to it, counted against :data:`MAX_MAPPINGS`; None where the system cannot map
    or the count is reached."""
    global _mappings
    if _MMAP is None or length <= 0:
        return None
    mmap, munmap = _MMAP
    with _mappings_lock:
        if _mappings >= MAX_MAPPINGS:
            return None
        _mappings += 1
    address = mmap(None, length, _PROT_READ | _PROT_WRITE, flags, fd, offset)
    if address is None or address == _MAP_FAILED:
        _unmapped()
        return None
    buffer = (ctypes.c_ubyte * length).from_address(address)
    # not at interpreter exit: an exit handler (a last save) may still read the tensors
    # that view it, and the process's end unmaps it anyway
    weakref.finalize(buffer, _unmap, munmap, address, length).atexit = False
    return buffer


def _unmap(munmap: Any, address: int, length: int) -> None:
    munmap(address, length)
    _unmapped()


def _unmapped() -> None:
    global _mappings
    with _mappings_lock:
        _mappings -= 1


def map_private(fd: int, length: int, offset: int = 0) -> Any | None:
    """``length`` bytes of the file ``fd`` from ``offset`` (a multiple of
    :data:`mmap.ALLOCATIONGRANULARITY`) mapped copy-on-write (``MAP_PRIVATE``,
    readable and writable: a write changes this process's copy, never the file), as a
    writable buffer that unmaps itself once nothing refers to it; ``fd`` may be closed
    at once. None where the system cannot map it (the caller reads instead).

    Through the C library, not Python's ``mmap`` module: that one keeps a duplicate of
    the descriptor open for as long as the mapping lives (before Python 3.13), and a
    load of thousands of mapped tensors would run out of descriptors."""
    return _mapped(_MAP_PRIVATE, fd, length, offset)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages to the disk now, without
    waiting (Linux ``sync_file_range``; elsewhere nothing): the later fsync then has
    little left to do, and the disk works while the writer encodes the next file."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd)
