"""What a rank holds, and steps 3 and 4 of a distributed save: the exchange of boundary
cells between ranks, which is also the agreement on whether any rank failed.

A rank's holdings are a :class:`FragmentSource` (boxes first, to plan; values when the
exchange and the write need them). :func:`exchange` sends each owner the cells of its
stored objects that other ranks hold; every rank sends every other its status too, so
that :func:`raise_if_failed` of what it received is the agreement (no further
collective). :func:`agree` is the agreement of the other collective steps.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ucpformat.checkpoint import deferred as feeds
from ucpformat.distributed.comm import (
    Communicator,
    error_report,
    gather_failures,
)
from ucpformat.distributed.save_plan import (
    RankTasks,
)
from ucpformat.errors import (
    LayoutError,
    UCPError,
    WriteError,
)
from ucpformat.layout.boxes import Box, as_slices, box_shape, box_size, contains

#: The cells received in the exchange: (tensor path, cell) -> values shaped like the cell.
Inbox = dict[tuple[str, Box], np.ndarray[Any, Any]]


# -- what a rank holds -------------------------------------------------------------------


@dataclass(frozen=True)
class Fragment:
    """Values of box ``box`` of tensor ``path``; ``data`` has as many elements, in C order."""

    path: str
    box: Box
    data: np.ndarray[Any, Any]

    def view(self) -> np.ndarray[Any, Any]:
        """The data shaped like the box (no copy for contiguous data)."""
        return self.data.reshape(box_shape(self.box))


class FragmentSource(Protocol):
    """What one rank holds: the boxes first (to plan), their values when they are needed."""

    def boxes(self) -> Iterable[tuple[str, Box]]:
        """(tensor path, box) of every fragment this rank holds; reads no values."""
        ...

    def fragments(self, path: str) -> Sequence[tuple[Box, np.ndarray[Any, Any]]]:
        """This rank's fragments of tensor ``path``, each value array shaped like its box.

        Called during the exchange and the write, once per tensor and step (it may copy
        from a device or read a file, and it may fail: the pipeline reports it).

        A source that is also :class:`ucpformat.checkpoint.deferred.Prefetching` (a staging area of
        bounded host buffers, :mod:`ucpformat.torch.staging`) is told the order of the
        write step's requests before it starts, told when each tensor's values are no
        longer needed (after the exchange has packed them, and after the write step has
        written its last stored object), and stopped at the end of the write step."""
        ...


class FragmentList:
    """A :class:`FragmentSource` of fragments held in memory."""

    def __init__(self, fragments: Sequence[Fragment]) -> None:
        self._fragments = list(fragments)
        self._by_path: dict[str, list[Fragment]] = {}
        for frag in self._fragments:
            self._by_path.setdefault(frag.path, []).append(frag)

    def boxes(self) -> list[tuple[str, Box]]:
        for frag in self._fragments:
            if frag.data.size != box_size(frag.box):
                raise WriteError(
                    f"fragment data has {frag.data.size} elements, box {list(frag.box)} needs "
                    f"{box_size(frag.box)}",
                    tensor=frag.path,
                )
        return [(frag.path, frag.box) for frag in self._fragments]

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        return [(frag.box, frag.view()) for frag in self._by_path.get(path, ())]


# -- agreement: the end of every collective step ----------------------------------------------


def agree(comm: Communicator, error: BaseException | None, step: str) -> None:
    """Collective: raise on every rank if any rank failed (``error``: this rank's failure).

    ``step`` says what the ranks were doing ("preparing the destination").
    """
    raise_if_failed(gather_failures(comm, error), step, error)


def raise_if_failed(
    failed: Sequence[tuple[int, str]], step: str, own: BaseException | None
) -> None:
    """Raise if ``failed`` ((rank, report) of every rank that failed, as every rank
    learned them) is not empty: this rank's own error if it is a UCPError, else a
    WriteError naming the ranks that failed."""
    if not failed:
        return
    if own is not None and isinstance(own, UCPError):
        raise own
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
    raise WriteError(
        f"distributed save failed while {step} ({detail}); nothing was committed"
    ) from own


# -- steps 3 and 4: the exchange, which is also an agreement ----------------------------------

#: After the cells a rank sends another: the length of its failure report, which precedes
#: it (a rank that failed sends its report alone, no cells).
_TRAILER = struct.Struct("<I")


@dataclass
class Exchanged:
    """What :func:`exchange` leaves a rank."""

    inbox: Inbox = field(default_factory=dict)  # the cells it received
    received_bytes: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)  # (rank, report), all ranks
    error: BaseException | None = None  # this rank's own failure, before or in the exchange


def exchange(
    comm: Communicator,
    tasks: RankTasks | None,
    source: FragmentSource,
    error: BaseException | None = None,
) -> Exchanged:
    """Step 3 (collective: every rank calls it, whether it failed or not, cells or not).

    Each rank sends every other rank the cells of that rank's objects it holds, in the
    plan's order, followed by its status: the report of its failure so far, empty if
    none. A rank that has failed (``error``; ``tasks`` None: it could not plan) or fails
    while reading its values sends its report alone. So every rank learns which ranks
    failed (``failed``), and step 4, the agreement, needs no further collective:
    :func:`raise_if_failed` of it. The received cells are checked against the plan's
    sizes; a mismatch (a bug) is this rank's ``error``, for the next agreement.
    """
    rank = comm.rank
    cells: dict[int, bytearray] = {}
    if error is None and tasks is not None:
        try:
            cells = _pack(tasks, source)
        except BaseException as exc:
            error, cells = exc, {}
    report = error_report(error).encode()
    outgoing: dict[int, bytes | memoryview] = {}
    for dst in range(comm.world_size):
        if dst != rank:
            # cells and a zero trailer (a buffer of zeros), or the report and its length
            body = cells.get(dst) or bytearray(_TRAILER.size)
            outgoing[dst] = (memoryview(body) if not report
                             else report + _TRAILER.pack(len(report)))
    received = comm.exchange(outgoing)
    result = Exchanged(error=error)
    if error is not None:
        result.failed.append((rank, report.decode()))
    bodies: dict[int, memoryview] = {}
    for src, raw in sorted(received.items()):
        view = memoryview(raw)
        if src == rank or len(view) < _TRAILER.size:
            continue
        (n,) = _TRAILER.unpack(view[-_TRAILER.size:])
        if n:
            result.failed.append((src, bytes(view[-_TRAILER.size - n:-_TRAILER.size]).decode(
                errors="replace")))
        else:
            bodies[src] = view[:-_TRAILER.size]
            result.received_bytes += len(view) - _TRAILER.size
    result.failed.sort()
    if not result.failed and tasks is not None:
        try:
            result.inbox = _unpack(tasks, bodies)
        except BaseException as exc:
            result.error = exc
    return result


def _pack(tasks: RankTasks, source: FragmentSource) -> dict[int, bytearray]:
    """Every cell this rank sends, in its owner's buffer at its planned offset (each
    buffer ends with a zero trailer: no failure)."""
    sizes = tasks.send_sizes()
    outgoing = {dst: bytearray(n + _TRAILER.size) for dst, n in sizes.items()}
    offsets = dict.fromkeys(outgoing, 0)
    current: str | None = None
    local: Sequence[tuple[Box, np.ndarray[Any, Any]]] = ()
    for owner, path, cell in tasks.sends:  # grouped by tensor: one resolution each
        if path != current:
            if current is not None:
                feeds.release(source, current)
            current, local = path, source.fragments(path)
        dt = tasks.arrays[path].dtype
        n = box_size(cell)
        dst = np.frombuffer(outgoing[owner], dtype=dt.numpy, count=n, offset=offsets[owner])
        dst.reshape(box_shape(cell))[...] = extract(local, path, cell)
        offsets[owner] += n * dt.itemsize
    if current is not None:
        feeds.release(source, current)
    return outgoing


def _unpack(tasks: RankTasks, received: Mapping[int, memoryview]) -> Inbox:
    """The received cells, as views of the received buffers, after checking their sizes."""
    expected = tasks.recv_sizes()
    for sender in sorted(set(expected) | set(received)):
        got, want = len(received.get(sender, b"")), expected.get(sender, 0)
        if got != want:
            raise WriteError(
                f"rank {sender} sent {got} bytes of boundary cells where the plan expects "
                f"{want}"
            )
    inbox: Inbox = {}
    offsets = dict.fromkeys(received, 0)
    for sender, path, cell in tasks.recvs:
        dt = tasks.arrays[path].dtype
        n = box_size(cell)
        raw = np.frombuffer(received[sender], dtype=dt.numpy, count=n, offset=offsets[sender])
        inbox[(path, cell)] = raw.reshape(box_shape(cell))
        offsets[sender] += n * dt.itemsize
    return inbox



def extract(
    local: Sequence[tuple[Box, np.ndarray[Any, Any]]], path: str, cell: Box
) -> np.ndarray[Any, Any]:
    """The values of ``cell`` from a local fragment that holds it whole (a view)."""
    for box, data in local:
        if contains(box, cell):
            return data[as_slices(relative_box(cell, box))]
    raise LayoutError(
        f"this rank holds no fragment containing {list(cell)}", rule="UCP-1.0-R131", tensor=path
    )



def relative_box(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of ``origin`` (which contains it)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


