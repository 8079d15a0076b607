"""A save's writer in a process of its own: the caller stages, a child process writes.

An asynchronous save in a background thread still spends the caller's CPU time and holds
its interpreter lock while it hashes, compresses, plans and writes. Here the caller only
copies its values into :class:`SharedArena` (host memory it shares with the child) and
sends what the fragments are: their tensors, boxes, and places in the arena (offsets,
shapes, strides, types). A long-lived child process, :class:`WriterProcess`, maps the
same memory and runs the one save pipeline on numpy views of it
(:func:`ucpformat.distributed.save_fragments`): CRCs, compression, JSON and file I/O
happen there, and it commits.

* **Shared memory without a name.** The arena is an anonymous ``memfd`` mapping; its file
  descriptor goes to the child over their socket (``SCM_RIGHTS``), so nothing is ever in
  ``/dev/shm`` and nothing outlives both processes, whatever way they end.
* **Several ranks.** Each rank has its own child; the children take part in the save's
  collectives over a communicator of their own, made in the child by ``connect`` (a
  picklable object whose ``connect()`` returns a
  :class:`~ucpformat.distributed.comm.Communicator`; ``ucpformat.torch`` gives a gloo
  group of the children). Without one, the child saves as a single process.
* **Failures.** An error in the child is raised by :meth:`WriterProcess.save` with its
  class (a :class:`~ucpformat.errors.UCPError` as it was, another error pickled, or a
  :class:`~ucpformat.errors.WriteError` naming it) and the child's traceback as a note.
  A child that dies is a :class:`WriterProcessError` naming its exit code or signal. The
  pipeline's guarantees are the child's: a failed save commits nothing.
* **Lifetime.** The child starts with :class:`WriterProcess`, serves one save after
  another, and ends at :meth:`WriterProcess.close` (asked to stop, then killed if it
  does not), when the object is collected or the interpreter exits, or, on its own,
  when the parent's end of the socket closes (the parent died). It ignores SIGINT and
  SIGTERM, which a terminal or a scheduler sends the parent too: the parent decides.

The child is started with ``sys.executable -c`` (no ``multiprocessing`` main-module
import, so a training script needs no ``if __name__ == "__main__"`` guard) and the
parent's ``sys.path``. Linux only (``os.memfd_create``).

The two processes speak pickle over their private socket (the save's arguments, its
result, an error): they are the same user's, and a store object or an error travels
whole. That is why this module lives with the torch integration, outside the format
core, which never unpickles (``tests/test_no_pickle.py``); it needs nothing of torch
itself, but the child imports ``ucpformat.torch`` (and so torch) to reach it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ucpformat.distributed.comm import Communicator, SingleProcess
from ucpformat.distributed.exchange import Fragment
from ucpformat.distributed.fragments import save_fragments
from ucpformat.distributed.pipeline import DistributedSaveResult
from ucpformat.distributed.rank_description import MeshPosition, MeshTensor
from ucpformat.errors import UCPError, WriteError, error_document, error_from_document

#: Seconds :meth:`WriterProcess.close` waits for the child to stop before terminating it.
STOP_TIMEOUT_S = 30.0


class WriterProcessError(WriteError):
    """The writer process died, or could not be started."""


class Connector(Protocol):
    """Makes the child's communicator, in the child (picklable: it travels there)."""

    def connect(self) -> Communicator: ...


# -- shared memory -------------------------------------------------------------------------------


class SharedArena:
    """Host memory shared with a writer process: one anonymous ``memfd`` mapping.

    :meth:`reserve` makes it at least a size (a new mapping, of a new
    :attr:`generation`, when it must grow: views of the old one must be gone by then).
    """

    def __init__(self, name: str = "ucp-staging") -> None:
        if not hasattr(os, "memfd_create"):
            raise WriterProcessError("a writer process needs Linux (os.memfd_create)")
        self.name = name
        self.fd = -1
        self.size = 0
        self.generation = 0
        self._map: mmap.mmap | None = None
        self._base = 0
        self._closer: weakref.finalize[Any, Any] | None = None  # closes ``fd``

    def reserve(self, nbytes: int) -> bool:
        """Make the arena hold at least ``nbytes``; True if it is a new mapping."""
        if nbytes <= self.size and self._map is not None:
            return False
        self.close()
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._closer = weakref.finalize(self, os.close, fd)
        self.fd, self.size = fd, size
        self.generation += 1
        self._base = int(self.array().ctypes.data)
        return True

    def array(self) -> np.ndarray[Any, Any]:
        """The whole arena as a writable ``uint8`` numpy array (no copy)."""
        if self._map is None:
            raise WriterProcessError("the shared arena is closed")
        return np.frombuffer(self._map, dtype=np.uint8)

    def offset_of(self, data: np.ndarray[Any, Any]) -> int:
        """Where ``data`` (a view of the arena) starts in it (ValueError if outside)."""
        start = int(data.__array_interface__["data"][0]) - self._base
        lo = start + sum(min(0, (n - 1) * s) for n, s in zip(data.shape, data.strides,
                                                               strict=True))
        hi = start + sum(max(0, (n - 1) * s) for n, s in zip(data.shape, data.strides,
                                                               strict=True))
        if data.size and (lo < 0 or hi + data.itemsize > self.size):
            raise ValueError("a fragment's values are not in the shared arena")
        return start

    def close(self) -> None:
        """Unmap and close (a view still alive keeps its mapping until it is collected)."""
        if self._map is not None:
            # views remain? then the mapping goes with the last of them
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._closer is not None:
            self._closer()
            self._closer = None
        self.fd = -1
        self.size = 0


# -- the parent's side -----------------------------------------------------------------------------


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _shutdown(proc: subprocess.Popen[bytes], conn: Connection, owner: int) -> None:
    """Ask the child to stop, wait, then kill it if need be (only in the process that
    started it: a forked copy of the parent that exits leaves the child alone)."""
    if os.getpid() != owner:
        return
    try:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()  # it ignores SIGTERM
                proc.wait()
    finally:
        conn.close()


class WriterProcess:
    """A child process that writes saves from a :class:`SharedArena` (one at a time).

    ``connector``: makes the child's communicator (several ranks); None: one process.
    ``nice``: added to the child's niceness (``os.nice``): a positive value lets the
    training process have the CPU first where both want it. :meth:`save` blocks until
    the child reports (call it from a background thread).
    """

    def __init__(self, connector: Connector | None = None, *, nice: int = 0) -> None:
        parent, child = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the directory holding ucpformat
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        code = ("import sys; from ucpformat.torch.writer_process import serve; "
                "serve(int(sys.argv[1]))")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(child.fileno())], pass_fds=(child.fileno(),),
                env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            parent.close()
            raise WriterProcessError(f"the writer process could not be started: {exc}") from exc
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._conn,
                                           os.getpid())
        self._lock = threading.Lock()
        self._ready = False
        self._generation = -1  # the arena generation the child has mapped
        self._conn.send(("init", list(sys.path), connector, nice))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _died(self, during: str) -> WriterProcessError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return WriterProcessError(
            f"the writer process (pid {self._proc.pid}) ended ({_how_it_ended(code)}) "
            f"{during}")

    def _receive(self, during: str) -> Any:
        """The child's next message (WriterProcessError if it died first)."""
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None and not self._conn.poll(0):
                raise self._died(during)
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died(during) from None

    def _send(self, message: Any, during: str) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionError):
            raise self._died(during) from None

    def wait_ready(self) -> None:
        """Wait until the child has started (and made its communicator)."""
        if self._ready:
            return
        reply = self._receive("while starting")
        if reply[0] != "ready":
            raise _raised(reply, self._proc.pid)
        self._ready = True

    def save(
        self,
        arena: SharedArena,
        path: Any,
        *,
        specs: Sequence[Any],
        fragments: Sequence[Fragment],
        group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
        meshes: Sequence[MeshPosition] = (),
        on_mesh: Sequence[MeshTensor] = (),
        metadata: Mapping[str, Any] | None = None,
        **save_kwargs: Any,
    ) -> DistributedSaveResult:
        """:func:`ucpformat.distributed.save_fragments` in the child, on ``fragments``
        whose values are views of ``arena``; raises the child's error."""
        where = f"before it reported the save to {path} (nothing says it committed)"
        with self._lock:
            if self._finalizer.alive is False:
                raise WriterProcessError("the writer process was closed")
            self.wait_ready()
            if arena.generation != self._generation:
                self._send(("arena", arena.size), where)
                send_handle(self._conn, arena.fd, self._proc.pid)
                self._generation = arena.generation
            described = [(f.path, f.box, arena.offset_of(f.data), f.data.shape,
                          f.data.strides, f.data.dtype) for f in fragments]
            request = {"path": path, "specs": list(specs), "fragments": described,
                       "group_attributes": group_attributes, "meshes": list(meshes),
                       "on_mesh": list(on_mesh), "metadata": metadata,
                       "save_kwargs": save_kwargs}
            try:
                payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise WriteError(f"the save's arguments cannot be sent to the writer "
                                 f"process: {exc}") from exc
            self._send(("save", payload), where)
            reply = self._receive(where)
            if reply[0] == "done":
                result: DistributedSaveResult = reply[1]
                return result
            raise _raised(reply, self._proc.pid)

    def close(self) -> None:
        """Stop the child (it finishes the save in flight; killed after
        :data:`STOP_TIMEOUT_S`) and close the socket."""
        self._finalizer()


def _raised(reply: Any, pid: int) -> BaseException:
    """The error of a ``("failed", kind, body, traceback)`` reply."""
    if reply[0] != "failed":
        return WriterProcessError(f"the writer process (pid {pid}) answered {reply[0]!r}")
    _, kind, body, tb = reply
    error: BaseException
    if kind == "ucp":
        error = error_from_document(body)
    elif kind == "pickled":
        try:
            error = pickle.loads(body)
        except Exception:
            error = WriteError(f"the writer process failed: {tb.strip().splitlines()[-1]}")
    else:
        error = WriteError(f"the writer process failed: {body}")
    if isinstance(error, BaseException):
        error.add_note(f"in the writer process (pid {pid}):\n{tb}")
    return error


# -- the child's side ------------------------------------------------------------------------------


def _failure(exc: BaseException) -> tuple[str, str, Any, str]:
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, UCPError):
        return ("failed", "ucp", error_document(exc), tb)
    try:
        return ("failed", "pickled", pickle.dumps(exc), tb)
    except Exception:
        return ("failed", "text", f"{type(exc).__name__}: {exc}", tb)


def _run_save(arena: mmap.mmap | None, comm: Communicator, payload: bytes
              ) -> DistributedSaveResult:
    request = pickle.loads(payload)
    frags = []
    for path, box, offset, shape, strides, dtype in request["fragments"]:
        if arena is None:
            raise WriterProcessError("a save arrived before its shared memory")
        data: np.ndarray[Any, Any] = np.ndarray(shape, dtype=dtype, buffer=arena,
                                                offset=offset, strides=strides)
        frags.append(Fragment(path, box, data))
    return save_fragments(
        request["path"], comm, specs=request["specs"], fragments=frags,
        group_attributes=request["group_attributes"], meshes=request["meshes"],
        on_mesh=request["on_mesh"], metadata=request["metadata"], **request["save_kwargs"])


def serve(fd: int) -> None:
    """The child: serve saves over the socket ``fd`` until told to stop or it closes.

    SIGINT and SIGTERM are ignored: a terminal's Ctrl-C or a scheduler's notice goes to
    the parent too, which ends the child (a save in flight completes first)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(fd)
    arena: mmap.mmap | None = None
    try:
        _, sys_path, connector, nice = conn.recv()
        sys.path.extend(p for p in sys_path if p not in sys.path)
        if nice:
            os.nice(nice)
        try:
            comm: Communicator = connector.connect() if connector is not None \
                else SingleProcess()
        except BaseException as exc:
            conn.send(_failure(exc))
            return
        conn.send(("ready", os.getpid()))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if message[0] == "stop":
                return
            if message[0] == "arena":
                new_fd = recv_handle(conn)
                try:
                    arena = mmap.mmap(new_fd, message[1])
                finally:
                    os.close(new_fd)
                continue
            try:
                result = _run_save(arena, comm, message[1])
            except BaseException as exc:
                conn.send(_failure(exc))
            else:
                conn.send(("done", result))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown of a process group left behind by a peer


__all__ = ["STOP_TIMEOUT_S", "Connector", "SharedArena", "WriterProcess", "WriterProcessError",
           "serve"]
