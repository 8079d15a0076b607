"""A ``Communicator`` over ``torch.distributed`` for the multi-process harness trials.

Uses ``ucpformat.torch.comm.TorchCommunicator`` when the library has it; otherwise a
minimal one here (JSON and bytes over ``all_gather`` of ``uint8`` tensors, no pickle).
"""

from __future__ import annotations

import base64
import importlib
import json
from collections.abc import Mapping
from typing import Any

from ucpformat.distributed.comm import Communicator


class _GlooCommunicator:
    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank: int = dist.get_rank()
        self.world_size: int = dist.get_world_size()

    def allgather(self, obj: Any) -> list[Any]:
        import torch

        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._dist.all_gather(bufs, mine)
        return [
            json.loads(bytes(b[: int(s.item())].numpy().tobytes()).decode())
            for b, s in zip(bufs, sizes, strict=True)
        ]

    def exchange(self, outgoing: Mapping[int, bytes | memoryview]) -> dict[int, bytes]:
        sent = self.allgather(
            {str(dst): base64.b64encode(bytes(buf)).decode() for dst, buf in outgoing.items()}
        )
        me = str(self.rank)
        return {src: base64.b64decode(d[me]) for src, d in enumerate(sent) if me in d}

    def barrier(self) -> None:
        self._dist.barrier()


def communicator() -> Communicator:
    """This process's rank of the default process group, as a ``Communicator``."""
    try:
        module = importlib.import_module("ucpformat.torch.comm")
    except ImportError:
        return _GlooCommunicator()
    comm: Communicator = module.TorchCommunicator()
    return comm
