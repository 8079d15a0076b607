"""What a distributed save needs from a process group, and an in-process implementation.

The format core speaks to ranks through :class:`Communicator`: gather JSON-able
descriptions, exchange byte buffers, agree on success. ``ucpformat.torch`` implements it
over ``torch.distributed`` (gloo or NCCL); :class:`ThreadGroup` runs N ranks as threads
of one process (tests, simulations, single-host tools).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Communicator(Protocol):
    """A group of ranks; every call is collective (all ranks call it, in the same order)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able ``obj``, indexed by rank."""
        ...

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        """Send ``outgoing[dst]`` to each dst; return what each src sent here."""
        ...

    def barrier(self) -> None: ...


class SingleProcess:
    """A communicator of one rank."""

    rank = 0
    world_size = 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        return {0: bytes(outgoing[0])} if 0 in outgoing else {}

    def barrier(self) -> None:
        return None


class _Shared:
    def __init__(self, size: int, timeout: float | None = None) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size


class ThreadGroup:
    """One rank of a group of threads in this process (see :func:`run_threads`)."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared = shared
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._shared.size

    def allgather(self, obj: Any) -> list[Any]:
        sh = self._shared
        sh.barrier.wait()
        sh.slots[self._rank] = obj
        sh.barrier.wait()
        out = list(sh.slots)
        sh.barrier.wait()
        return out

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        gathered = self.allgather({dst: bytes(buf) for dst, buf in outgoing.items()})
        return {src: sent[self._rank] for src, sent in enumerate(gathered) if self._rank in sent}

    def barrier(self) -> None:
        self._shared.barrier.wait()


def run_threads(
    world_size: int, fn: Callable[[ThreadGroup], T], *, timeout: float | None = None
) -> list[T]:
    """Run ``fn(comm)`` on ``world_size`` threads, one rank each; results by rank.

    If any rank raises, the barrier is broken so no rank hangs, and the first error is
    re-raised. ``timeout``: seconds a rank waits in a collective for the others before
    the collective fails (``threading.BrokenBarrierError``) on every rank; None: no limit.
    """
    shared = _Shared(world_size, timeout)

    def run(rank: int) -> T:
        try:
            return fn(ThreadGroup(shared, rank))
        except BaseException:
            shared.barrier.abort()
            raise

    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(run, r) for r in range(world_size)]
        errors: list[BaseException] = []
        results: list[Any] = []
        for f in futures:
            try:
                results.append(f.result())
            except threading.BrokenBarrierError as exc:
                errors.append(exc)
                results.append(None)
            except BaseException as exc:
                errors.insert(0, exc)
                results.append(None)
        if errors:
            raise errors[0]
        return results


def gather_bytes(comm: Communicator, payload: bytes, root: int = 0) -> list[bytes] | None:
    """Collective: every rank's ``payload``, by rank, on ``root`` (None on the others).

    One :meth:`Communicator.exchange`: a rank sends only its own bytes, and only the
    root receives (the cost on a rank does not grow with the others' payloads)."""
    received = comm.exchange({root: payload})
    if comm.rank != root:
        return None
    return [received.get(r, b"") for r in range(comm.world_size)]


def scatter_bytes(comm: Communicator, outgoing: Mapping[int, bytes] | None,
                  root: int = 0) -> bytes:
    """Collective: ``root`` sends ``outgoing[r]`` to each rank r (the others pass None);
    every rank returns what it was sent (b"" if nothing)."""
    if comm.rank == root and outgoing is None:
        raise ValueError("the root of a scatter must give what each rank receives")
    received = comm.exchange(dict(outgoing or {}) if comm.rank == root else {})
    return received.get(root, b"")


def error_report(error: BaseException | None) -> str:
    """What a rank tells the others of its failure: "" for none."""
    return "" if error is None else f"{type(error).__name__}: {error}"


def failed_ranks(reports: Sequence[str]) -> list[tuple[int, str]]:
    """(rank, report) of every rank whose gathered :func:`error_report` is not empty."""
    return [(rank, report) for rank, report in enumerate(reports) if report]


def gather_failures(comm: Communicator, error: BaseException | None) -> list[tuple[int, str]]:
    """Collective: (rank, report) of every rank that failed (``error`` is this rank's)."""
    return failed_ranks(comm.allgather(error_report(error)))


__all__ = ["Communicator", "SingleProcess", "ThreadGroup", "error_report", "failed_ranks",
           "gather_bytes", "gather_failures", "run_threads", "scatter_bytes"]
