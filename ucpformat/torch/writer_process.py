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
  collectives over a communicator of their own, made in the child by ``connector``
  (an object whose ``connect()`` returns a
  :class:`~ucpformat.distributed.comm.Communicator`, of a kind that travels as JSON:
  :data:`~ucpformat.torch.writer_wire.CONNECTOR_KINDS`; ``ucpformat.torch`` gives a
  :class:`~ucpformat.torch.comm.GlooConnector`, a gloo group of the children). Without
  one, the child saves as a single process.
* **Failures.** An error in the child is raised by :meth:`WriterProcess.save` with its
  class (a :class:`~ucpformat.errors.UCPError` as it was; another error as a
  :class:`~ucpformat.errors.WriteError` naming its class and message) and the child's
  traceback as a note. A child that dies is a :class:`WriterProcessError` naming its
  exit code or signal. The pipeline's guarantees are the child's: a failed save commits
  nothing.
* **Lifetime.** The child starts with :class:`WriterProcess`, serves one save after
  another, and ends at :meth:`WriterProcess.close` (asked to stop, then killed if it
  does not), when the object is collected or the interpreter exits, or, on its own,
  when the parent's end of the socket closes (the parent died). It ignores SIGINT and
  SIGTERM, which a terminal or a scheduler sends the parent too: the parent decides.

The child is started with ``sys.executable -c`` (no ``multiprocessing`` main-module
import, so a training script needs no ``if __name__ == "__main__"`` guard) and the
parent's ``sys.path``. Linux only (``os.memfd_create``).

The two processes speak JSON over their private socket, one message per frame
(:mod:`ucpformat.torch.writer_wire` gives every object that travels its JSON form: the
save's arguments, its result, an error), never pickle: the child reads what it is sent
as a reader reads a checkpoint, with no way to make it run code, and the format's rule
(nothing is ever unpickled, ``tests/test_no_pickle.py``) holds here too. What has no JSON
form is refused in the parent before the child does anything: a store other than a
path, a URL, a plain ``LocalStore`` or an ``FsspecStore`` with JSON storage options (pass
a path or URL), a connector of an unknown kind, a ``progress`` callback. The arena's
file descriptor goes as ``SCM_RIGHTS`` ancillary data
(:func:`multiprocessing.reduction.send_handle`, a one-byte message, no pickle). The
module lives with the torch integration: it needs nothing of torch itself, but the
child imports ``ucpformat.torch`` (and so torch) to reach it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
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
from ucpformat.errors import WriteError
from ucpformat.torch.writer_wire import (
    FragmentPlace,
    SaveRequest,
    connector_from_json,
    connector_to_json,
    decode_message,
    encode_message,
    error_from_json,
    error_to_json,
    request_to_json,
    result_from_json,
    result_to_json,
)

#: Seconds :meth:`WriterProcess.close` waits for the child to stop before terminating it.
STOP_TIMEOUT_S = 30.0


class WriterProcessError(WriteError):
    """The writer process died, or could not be started."""


class Connector(Protocol):
    """Makes the child's communicator, in the child (of a kind in
    :data:`~ucpformat.torch.writer_wire.CONNECTOR_KINDS`: it travels there as JSON)."""

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
                conn.send_bytes(encode_message({"kind": "stop"}))
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()  # it ignores SIGTERM
                proc.wait()
    finally:
        conn.close()


class WriterProcess:
    """A child process that writes saves from a :class:`SharedArena` (one at a time).

    ``connector``: makes the child's communicator (several ranks; of a kind that
    travels, else :class:`~ucpformat.errors.InvalidValueError` before anything starts);
    None: one process.
    ``nice``: added to the child's niceness (``os.nice``): a positive value lets the
    training process have the CPU first where both want it. :meth:`save` blocks until
    the child reports (call it from a background thread).
    """

    def __init__(self, connector: Connector | None = None, *, nice: int = 0) -> None:
        start = encode_message({"kind": "init", "sys_path": list(sys.path),
                                "connector": connector_to_json(connector), "nice": int(nice)})
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
        self._conn.send_bytes(start)

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

    def _receive(self, during: str) -> dict[str, Any]:
        """The child's next message (WriterProcessError if it died first)."""
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None and not self._conn.poll(0):
                raise self._died(during)
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise self._died(during) from None
        return decode_message(data)

    def _send(self, message: dict[str, Any], during: str) -> None:
        try:
            self._conn.send_bytes(encode_message(message))
        except (BrokenPipeError, ConnectionError):
            raise self._died(during) from None

    def wait_ready(self) -> None:
        """Wait until the child has started (and made its communicator)."""
        if self._ready:
            return
        reply = self._receive("while starting")
        if reply["kind"] != "ready":
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
        whose values are views of ``arena``; raises the child's error. What cannot
        travel as JSON (:mod:`~ucpformat.torch.writer_wire`: a store object other than
        a LocalStore or FsspecStore, a ``progress`` callback) raises
        :class:`~ucpformat.errors.InvalidValueError` before the child hears of it."""
        where = f"before it reported the save to {path} (nothing says it committed)"
        with self._lock:
            if self._finalizer.alive is False:
                raise WriterProcessError("the writer process was closed")
            places = [FragmentPlace(f.path, f.box, arena.offset_of(f.data), f.data.shape,
                                    f.data.strides, f.data.dtype) for f in fragments]
            request = request_to_json(
                path, specs=specs, fragments=places, group_attributes=group_attributes,
                meshes=meshes, on_mesh=on_mesh, metadata=metadata, save_kwargs=save_kwargs)
            self.wait_ready()
            if arena.generation != self._generation:
                self._send({"kind": "arena", "size": arena.size}, where)
                send_handle(self._conn, arena.fd, self._proc.pid)
                self._generation = arena.generation
            self._send({"kind": "save", "request": request}, where)
            reply = self._receive(where)
            if reply["kind"] == "done":
                return result_from_json(reply["result"])
            raise _raised(reply, self._proc.pid)

    def close(self) -> None:
        """Stop the child (it finishes the save in flight; killed after
        :data:`STOP_TIMEOUT_S`) and close the socket."""
        self._finalizer()


def _raised(reply: dict[str, Any], pid: int) -> BaseException:
    """The error of a ``failed`` reply (:func:`~ucpformat.torch.writer_wire.error_to_json`)."""
    if reply["kind"] != "failed":
        return WriterProcessError(f"the writer process (pid {pid}) answered {reply['kind']!r}")
    return error_from_json(reply, pid)


# -- the child's side ------------------------------------------------------------------------------


def _run_save(arena: mmap.mmap | None, comm: Communicator, doc: dict[str, Any]
              ) -> DistributedSaveResult:
    request = SaveRequest.from_json(doc)
    frags = []
    for place in request.fragments:
        if arena is None:
            raise WriterProcessError("a save arrived before its shared memory")
        data: np.ndarray[Any, Any] = np.ndarray(place.shape, dtype=place.dtype, buffer=arena,
                                                offset=place.offset, strides=place.strides)
        frags.append(Fragment(place.path, place.box, data))
    return save_fragments(
        request.location, comm, specs=request.specs, fragments=frags,
        group_attributes=request.group_attributes, meshes=request.meshes,
        on_mesh=request.on_mesh, metadata=request.metadata, **request.save_kwargs)


def serve(fd: int) -> None:
    """The child: serve saves over the socket ``fd`` until told to stop or it closes.

    SIGINT and SIGTERM are ignored: a terminal's Ctrl-C or a scheduler's notice goes to
    the parent too, which ends the child (a save in flight completes first)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(fd)
    arena: mmap.mmap | None = None

    def send(message: dict[str, Any]) -> None:
        conn.send_bytes(encode_message(message))

    try:
        try:
            start = decode_message(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        sys.path.extend(p for p in start["sys_path"] if p not in sys.path)
        if start["nice"]:
            os.nice(int(start["nice"]))
        try:
            connector = connector_from_json(start["connector"])
            comm: Communicator = connector.connect() if connector is not None \
                else SingleProcess()
        except BaseException as exc:
            send(error_to_json(exc))
            return
        send({"kind": "ready", "pid": os.getpid()})
        while True:
            try:
                message = decode_message(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the parent is gone
            if message["kind"] == "stop":
                return
            if message["kind"] == "arena":
                new_fd = recv_handle(conn)
                try:
                    arena = mmap.mmap(new_fd, int(message["size"]))
                finally:
                    os.close(new_fd)
                continue
            try:
                result = _run_save(arena, comm, message["request"])
            except BaseException as exc:
                send(error_to_json(exc))
            else:
                send({"kind": "done", "result": result_to_json(result)})
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown of a process group left behind by a peer


__all__ = ["STOP_TIMEOUT_S", "Connector", "SharedArena", "WriterProcess", "WriterProcessError",
           "serve"]
