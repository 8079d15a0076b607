"""``ucpformat.distributed.comm.Communicator`` over a ``torch.distributed`` process group.

The format core's distributed writer speaks to ranks through three collectives:
``allgather`` of JSON-able descriptions, ``exchange`` of byte buffers, ``barrier``.
:class:`TorchCommunicator` implements them with tensor collectives that gloo (CPU) and
NCCL (GPU) both support:

* ``allgather``: the object is JSON-encoded (never pickled), the lengths are gathered,
  then the padded byte tensors (``all_gather``);
* ``exchange``: a round of ``all_to_all_single`` on the byte counts, then one
  ``all_to_all_single`` of ``uint8`` tensors with uneven splits;
* ``barrier``: ``torch.distributed.barrier``.

NCCL needs device tensors; the communicator stages the bytes on the group's device
(:func:`collective_device`: ``cuda:<current device>`` for NCCL, the CPU for gloo and
for a group with a CPU backend, such as ``"cpu:gloo,cuda:nccl"``). Nothing else in the
pipeline depends on the backend: the exchanged cells and gathered descriptions are
bytes in host memory either way. A checkpoint is best written
over a separate gloo group (:func:`checkpoint_group`): its byte buffers are in host
memory already, and it never interleaves with the training's collectives (which
matters for asynchronous saves, whose collectives run in a background thread).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ucpformat.distributed.comm import Communicator, SingleProcess

ProcessGroup = dist.ProcessGroup


class TorchCommunicator:
    """One rank of a ``torch.distributed`` process group (default: the world)."""

    def __init__(
        self, group: ProcessGroup | None = None, *, device: torch.device | str | None = None
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group first "
                "(or use ucpformat.distributed.comm.SingleProcess for one process)"
            )
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        if device is None:
            device = collective_device(str(dist.get_backend(group)))
        self.device = torch.device(device)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- byte helpers ------------------------------------------------------------------

    def _bytes_tensor(self, data: bytes | memoryview, size: int | None = None) -> torch.Tensor:
        n = len(data) if size is None else size
        out = torch.zeros(n, dtype=torch.uint8)
        if len(data):
            out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out.to(self.device) if self.device.type != "cpu" else out

    def _allgather_sizes(self, n: int) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device)
                 for _ in range(self._world_size)]
        dist.all_gather(sizes, mine, group=self.group)
        return [int(s.item()) for s in sizes]

    # -- the Communicator protocol ---------------------------------------------------------

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able ``obj``, by rank (JSON on the wire, never pickle)."""
        payload = json.dumps(obj, separators=(",", ":")).encode()
        sizes = self._allgather_sizes(len(payload))
        longest = max(sizes)
        mine = self._bytes_tensor(payload, longest)
        bufs = [torch.empty(longest, dtype=torch.uint8, device=self.device)
                for _ in range(self._world_size)]
        dist.all_gather(bufs, mine, group=self.group)
        out = []
        for buf, n in zip(bufs, sizes, strict=True):
            raw = buf[:n].cpu().numpy().tobytes()
            out.append(json.loads(raw.decode()))
        return out

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        """Send ``outgoing[dst]`` to each ``dst``; return what each source sent here."""
        for dst in outgoing:
            if not 0 <= dst < self._world_size:
                raise ValueError(f"destination rank {dst} outside world size {self._world_size}")
        send_sizes = [len(outgoing[d]) if d in outgoing else 0 for d in range(self._world_size)]
        send_t = torch.tensor(send_sizes, dtype=torch.int64, device=self.device)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=self.group)
        recv_sizes = [int(x) for x in recv_t.cpu().tolist()]
        parts = [np.frombuffer(outgoing[d], dtype=np.uint8) for d in range(self._world_size)
                 if send_sizes[d]]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        send = torch.from_numpy(flat)
        if self.device.type != "cpu":
            send = send.to(self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        data = recv.cpu().numpy()
        out: dict[int, bytes] = {}
        pos = 0
        for src, n in enumerate(recv_sizes):
            if n:
                out[src] = data[pos : pos + n].tobytes()
            pos += n
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def collective_device(backend: str, *, cuda_available: bool | None = None,
                      current_device: int | None = None) -> torch.device:
    """The device on which a group of ``backend`` runs byte collectives.

    The CPU when the backend takes CPU tensors (gloo, mpi, or a per-device map with a
    ``cpu`` entry: ``"cpu:gloo,cuda:nccl"``); the current CUDA device for NCCL (or a map
    with only a ``cuda`` entry). NCCL without CUDA raises ``RuntimeError``.
    """
    name = backend.lower().strip()
    if ":" in name:  # a per-device map
        entries = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        if "cpu" in entries:
            return torch.device("cpu")
        name = entries.get("cuda", name)
    if name != "nccl":
        return torch.device("cpu")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not available:
        raise RuntimeError("the process group's backend is NCCL, which needs CUDA tensors, "
                           "but CUDA is not available")
    index = torch.cuda.current_device() if current_device is None else current_device
    return torch.device("cuda", index)


def communicator(group: ProcessGroup | None = None) -> Communicator:
    """A communicator for ``group``; one of a single process when torch.distributed is off."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not "
                               "initialized")
        return SingleProcess()
    return TorchCommunicator(group)


def checkpoint_group(ranks: list[int] | None = None) -> ProcessGroup | None:
    """A new gloo process group for checkpoint traffic (collective: every rank calls it).

    Saving over its own group keeps checkpoint collectives apart from the training's:
    an asynchronous save runs its collectives from a background thread while training
    goes on with the default group, and the two must never interleave on one group.
    gloo works on host memory, where a save's snapshot is. ``None`` without
    torch.distributed.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    group: ProcessGroup | None = dist.new_group(ranks=ranks, backend="gloo")
    return group


@dataclass(frozen=True)
class GlooConnector:
    """How the writer processes of one saver's ranks form a gloo group of their own
    (:class:`ucpformat.torch.writer_process.WriterProcess`): each joins as its
    parent's rank in the saver's group, by a TCP rendezvous at ``address:port`` (on the
    group's rank 0; :func:`writer_connector`). ``timeout_s``: how long a child waits in
    a collective for the others (a peer that died). It travels to the child as JSON, its
    fields (:mod:`ucpformat.torch.writer_wire`)."""

    address: str
    port: int
    rank: int
    world_size: int
    timeout_s: float = 1800.0

    def connect(self) -> Communicator:
        """In the child: join the group; its communicator."""
        dist.init_process_group("gloo", init_method=f"tcp://{self.address}:{self.port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        return TorchCommunicator()


def writer_connector(comm: Communicator) -> GlooConnector:
    """Collective over ``comm``: the :class:`GlooConnector` of its ranks' writer processes
    (rank 0 picks a free port on its host, named by ``MASTER_ADDR`` if set)."""
    mine: list[Any] | None = None
    if comm.rank == 0:
        address = os.environ.get("MASTER_ADDR") or socket.getfqdn()
        with socket.socket() as s:
            s.bind(("", 0))
            mine = [address, int(s.getsockname()[1])]
    address, port = comm.allgather(mine)[0]
    return GlooConnector(str(address), int(port), comm.rank, comm.world_size)


__all__ = ["GlooConnector", "TorchCommunicator", "checkpoint_group", "collective_device",
           "communicator", "writer_connector"]
