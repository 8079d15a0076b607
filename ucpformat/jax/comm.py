"""A :class:`~ucpformat.distributed.comm.Communicator` over JAX's multi-process runtime.

One process: :class:`ucpformat.distributed.comm.SingleProcess`. Several (``jax.distributed``
initialized): :class:`CoordinationCommunicator`, whose collectives go through the
coordination service that ``jax.distributed.initialize`` already runs (its key-value
store and its barrier), so a save needs no second runtime.

This is the only module of ucpformat that touches a private JAX name:
``jax._src.distributed.global_state.client``. JAX's public API has no key-value store
or named barrier (``jax.experimental.multihost_utils`` offers array collectives that
compile and run a program on every device, and ``sync_global_devices``, which is a
barrier but no way to send bytes), and the key-value store is what Orbax itself uses
for the same purpose. If JAX moves it, :func:`runtime_client` is the one place to
change; until then a missing client is a :class:`~ucpformat.errors.MissingDependencyError`
naming it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from ucpformat.distributed.comm import Communicator, SingleProcess
from ucpformat.errors import MissingDependencyError, WriteError
from ucpformat.optional import require

#: Largest value put in the key-value store at once; bigger payloads are split.
PART_BYTES = 4 << 20

_sessions = itertools.count()


def runtime_client() -> Any:
    """The coordination service client of ``jax.distributed`` (private to JAX: see the
    module docstring), or a MissingDependencyError if this JAX has none."""
    require("jax", extra="jax", purpose="ucpformat.jax")
    try:
        from jax._src.distributed import global_state
    except ImportError as exc:  # pragma: no cover - depends on the JAX version
        raise MissingDependencyError(
            "ucpformat.jax needs jax._src.distributed.global_state (JAX's coordination "
            f"service client), which this JAX does not have: use jax 0.10 ({exc})") from exc
    client = getattr(global_state, "client", None)
    if client is None:
        raise MissingDependencyError(
            "several JAX processes but no coordination service client: call "
            "jax.distributed.initialize() before saving or loading")
    return client


class CoordinationCommunicator:
    """The processes of a ``jax.distributed`` run, one rank each (rank = process index).

    Every collective writes keys under a prefix unique to this communicator and call
    (communicators are made in the same order on every process: one per save), and
    each key is deleted by the one process that reads it. ``timeout_s``: how long a
    process waits for another in a collective before it fails with a WriteError."""

    def __init__(self, client: Any, rank: int, world_size: int, *, timeout_s: float = 600.0,
                 name: str | None = None) -> None:
        self._client = client
        self._rank = rank
        self._world = world_size
        self._timeout_ms = int(timeout_s * 1000)
        self._prefix = f"ucpformat/{name if name is not None else next(_sessions)}"
        self._calls = itertools.count()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _key(self, call: int, src: int, dst: int) -> str:
        return f"{self._prefix}/{call}/{src}-{dst}"

    def _get(self, key: str) -> bytes:
        try:
            return bytes(self._client.blocking_key_value_get_bytes(key, self._timeout_ms))
        except Exception as exc:  # the runtime raises its own error types
            raise WriteError(f"process {self._rank} waited in vain for {key!r} in the "
                             f"coordination service ({type(exc).__name__}: {exc})") from exc

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        call = next(self._calls)
        for dst in range(self._world):
            if dst == self._rank:
                continue
            buf = outgoing.get(dst)
            key = self._key(call, self._rank, dst)
            if buf is None:
                self._client.key_value_set_bytes(key, b"-")
                continue
            data = memoryview(buf).cast("B")
            parts = max(1, -(-len(data) // PART_BYTES))
            for i in range(parts):
                self._client.key_value_set_bytes(
                    f"{key}#{i}", bytes(data[i * PART_BYTES:(i + 1) * PART_BYTES]))
            self._client.key_value_set_bytes(key, str(parts).encode())
        received: dict[int, bytes] = {}
        if self._rank in outgoing:
            received[self._rank] = bytes(outgoing[self._rank])
        for src in range(self._world):
            if src == self._rank:
                continue
            key = self._key(call, src, self._rank)
            head = self._get(key)
            self._client.key_value_delete(key)
            if head == b"-":
                continue
            chunks = []
            for i in range(int(head)):  # not below the head: deleting a key deletes those
                chunks.append(self._get(f"{key}#{i}"))
                self._client.key_value_delete(f"{key}#{i}")
            received[src] = b"".join(chunks)
        return received

    def allgather(self, obj: Any) -> list[Any]:
        import json

        mine = json.dumps(obj).encode()
        received = self.exchange(dict.fromkeys(range(self._world), mine))
        return [json.loads(received[r]) for r in range(self._world)]

    def barrier(self) -> None:
        call = next(self._calls)
        try:
            self._client.wait_at_barrier(f"{self._prefix}/{call}/barrier", self._timeout_ms)
        except Exception as exc:
            raise WriteError(f"process {self._rank} timed out at a barrier of the "
                             f"coordination service ({type(exc).__name__}: {exc})") from exc


def communicator(*, timeout_s: float = 600.0) -> Communicator:
    """The communicator of this JAX run: one rank per process (``jax.process_index()``)."""
    jax = require("jax", extra="jax", purpose="ucpformat.jax")
    world = int(jax.process_count())
    if world == 1:
        return SingleProcess()
    return CoordinationCommunicator(runtime_client(), int(jax.process_index()), world,
                                    timeout_s=timeout_s)


__all__ = ["PART_BYTES", "CoordinationCommunicator", "communicator", "runtime_client"]
