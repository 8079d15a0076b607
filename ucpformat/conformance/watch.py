"""Count the writes of every file under a folder while a writer runs (Linux inotify).

UCP-1.0-R130 (one writer per stored object, never a read-modify-write) is a property of
the writing process, not of the checkpoint it leaves. Watching the folder with inotify
shows it: a stored object closed after writing (or renamed into place) more than once
was written more than once. Best effort: a folder created and filled faster than its
watch is added is counted once when the watch is added, unless the file's creation event
follows (then its events are all coming); the close of a write that was under way then
is not counted again (no open of the file was seen since), nor is a rename already seen
(same inode, time and size). A race can hide a repeated write, never invent one.

The race this must not turn into a second write: ``open(O_CREAT)`` reports the file's
creation (on its folder) and its opening as two events, a moment apart, from one system
call. A watch added to a new folder in between (a writer that creates folders as it goes
opens its first file there just as the watcher adds the folder's watch) sees the opening
but not the creation; the scan then finds the file, and that opening looked like a
second one. So every scan is followed by a marker, a file created in a private folder
watched by the same inotify instance (whose events come in one queue, in order): an
opening of a scanned file reported before its scan's marker happened before the scan
ended, and belongs to the write the scan counted; only openings after the marker begin
another write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

IN_OPEN = 0x00000020
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
_EVENT = struct.Struct("iIII")


def available() -> bool:
    return sys.platform.startswith("linux") and _libc() is not None


def _libc() -> ctypes.CDLL | None:
    try:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        lib.inotify_init1  # noqa: B018 - probes for the symbol
        return lib
    except (OSError, AttributeError):
        return None


class WriteCounter:
    """``with WriteCounter(folder) as w: ...``; then ``w.counts`` maps relative paths to writes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.counts: Counter[str] = Counter()
        self.ok = False
        self._seen: dict[str, tuple[int, int, int] | None] = {}
        self._scanned: set[str] = set()  # counted by a scan, its close not seen yet
        self._opened: set[str] = set()  # opened since its scan's marker
        self._scan_of: dict[str, int] = {}  # scanned file -> the number of its scan's marker
        self._markers_seen = -1  # the highest marker whose creation has been read
        self._next_marker = 0
        self._marker_dir: Path | None = None
        self._marker_wd = -1
        self._lib = _libc() if available() else None
        self._fd = -1
        self._watches: dict[int, Path] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WriteCounter:
        if self._lib is None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = self._lib.inotify_init1(IN_NONBLOCK)
        if self._fd < 0:
            return self
        self.ok = True
        self._marker_dir = Path(tempfile.mkdtemp(prefix="ucp-watch-markers-"))
        self._marker_wd = self._lib.inotify_add_watch(self._fd, os.fsencode(self._marker_dir),
                                                      IN_CREATE)
        self._add_tree(self.root)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _add(self, path: Path) -> None:
        assert self._lib is not None
        wd = self._lib.inotify_add_watch(self._fd, os.fsencode(path),
                                         IN_OPEN | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)
        if wd >= 0:
            self._watches[wd] = path

    def _add_tree(self, path: Path) -> None:
        self._add(path)
        for sub in sorted(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink()):
            self._add(sub)
        # files written before their folder was watched: count each once
        scan = self._next_marker
        for file in path.rglob("*"):
            if file.is_file() and not file.is_symlink():
                rel = self._rel(file)
                if rel not in self._seen:
                    self._seen[rel] = _signature(file)
                    self._scanned.add(rel)
                    self._scan_of[rel] = scan
                    self.counts[rel] += 1
        self._mark(scan)

    def _mark(self, scan: int) -> None:
        """Put the marker of scan ``scan`` in the event queue, after every event of the scan."""
        self._next_marker = scan + 1
        if self._marker_dir is not None and self._marker_wd >= 0:
            (self._marker_dir / str(scan)).touch()
        else:  # no marker can come: take every opening from now on as a new one
            self._markers_seen = scan

    def _rel(self, full: Path) -> str:
        return full.relative_to(self.root).as_posix()

    def _event(self, full: Path, mask: int) -> None:
        rel = self._rel(full)
        if mask & IN_CREATE:
            if rel in self._scanned:  # created after its folder was watched: its events
                self._scanned.discard(rel)  # are all coming, so the scan's count goes
                self._opened.discard(rel)
                self._seen.pop(rel, None)
                self.counts[rel] -= 1
            return
        if mask & IN_OPEN:
            # an opening reported before the scan's marker happened before the scan
            # ended: the write the scan counted (its creating open, say, whose creation
            # event came before the watch), not another one
            if rel in self._scanned and self._scan_of.get(rel, -1) <= self._markers_seen:
                self._opened.add(rel)
            return
        sig = _signature(full)
        if rel in self._scanned:
            self._scanned.discard(rel)
            opened = rel in self._opened
            self._opened.discard(rel)
            if mask & IN_CLOSE_WRITE and not opened:
                return  # the end of the write the scan saw under way
            if mask & IN_MOVED_TO and sig is not None and sig == self._seen.get(rel):
                return  # the rename the scan saw done
        self._seen[rel] = sig
        self.counts[rel] += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if ready:
                self._drain()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
                offset += _EVENT.size + length
                name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                if wd == self._marker_wd and wd >= 0:
                    if mask & IN_CREATE and name.isdigit():
                        self._markers_seen = max(self._markers_seen, int(name))
                    continue
                base = self._watches.get(wd)
                if base is None or not name:
                    continue
                full = base / name
                if mask & IN_ISDIR:
                    if mask & (IN_CREATE | IN_MOVED_TO):
                        self._add_tree(full)
                    continue
                if mask & (IN_CREATE | IN_OPEN | IN_CLOSE_WRITE | IN_MOVED_TO):
                    self._event(full, mask)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._marker_dir is not None:
            shutil.rmtree(self._marker_dir, ignore_errors=True)
            self._marker_dir = None


def wait_for_change(folder: Path, *, given_up: Callable[[], bool], timeout: float) -> bool:
    """Wait until something is created in (or moved into) ``folder``: True then; False if
    ``given_up()`` turns true first, or after ``timeout`` seconds, or without inotify."""
    lib = _libc() if available() else None
    if lib is None:
        return False
    fd = lib.inotify_init1(IN_NONBLOCK)
    if fd < 0:
        return False
    try:
        if lib.inotify_add_watch(fd, os.fsencode(folder), IN_CREATE | IN_MOVED_TO) < 0:
            return False
        if any(folder.iterdir()):  # changed before the watch was added
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.002)
            if ready:
                return True
            if given_up():
                return any(folder.iterdir())
        return False
    finally:
        os.close(fd)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


__all__ = ["WriteCounter", "available", "wait_for_change"]
