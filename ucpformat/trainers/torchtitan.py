"""torchtitan's checkpoint manager saves and loads UCP.

Selected by its config, where torchtitan's trainer builds the manager from
``Trainer.Config.checkpoint``::

    from ucpformat.trainers.torchtitan import UCPCheckpointManager
    checkpoint = UCPCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                             async_mode="async")

Every ``step-<N>`` folder is one UCP checkpoint written through the DCP plugin
(:class:`ucpformat.torch.dcp.UCPWriter` / ``UCPReader`` with
:meth:`~ucpformat.torch.dcp_keys.KeyMap.torchtitan`: model FQNs at the top level,
``optimizer`` flattened by FQN), synchronously or with ``dcp.async_save``
(``async_mode="async"``); ``load()`` finds the newest committed UCP step folder (DCP's
own ``.metadata`` folders still count); ``keep_latest_k`` deletes old ones the UCP way
(:func:`ucpformat.trainers.common.remove`). The Hugging Face export and import
(``last_save_in_hf``, ``initial_load_in_hf``) stay torchtitan's own (safetensors).

A state that DCP hands over as bytes is refused, named: torchtitan's dataloader pickles
its state into bytes, and ucpformat writes no pickle. Leave the dataloader out of the
manager (``dataloader=None``) or give it a state of tensors and JSON values.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucpformat.errors import InvalidValueError, LoadError
from ucpformat.optional import require
from ucpformat.trainers.common import check_version, remove

torchtitan = require("torchtitan", extra="torchtitan", purpose="ucpformat.trainers.torchtitan")
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_state  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import async_save, save  # noqa: E402
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER  # noqa: E402
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager  # noqa: E402

from ucpformat.torch.dcp import UCPWriter  # noqa: E402
from ucpformat.torch.dcp_keys import KeyMap  # noqa: E402
from ucpformat.torch.dcp_reader import UCPReader  # noqa: E402

#: The torchtitan versions (major.minor, first and last) this manager was tested with.
TESTED = ((0, 3), (0, 3))
check_version("torchtitan", getattr(torchtitan, "__version__", "0.3.0"), TESTED)
_STEP = re.compile(r"step-(\d+)")


def _refuse_bytes(state: Mapping[str, Any], where: str = "") -> None:
    for key, value in state.items():
        at = f"{where}.{key}" if where else str(key)
        if isinstance(value, bytes | bytearray | io.BytesIO):
            raise InvalidValueError(
                "holds bytes (torchtitan's dataloader pickles its state into bytes); "
                "ucpformat writes no pickle: leave it out of the checkpoint manager",
                path=at)
        if isinstance(value, Mapping):
            _refuse_bytes(value, at)


class UCPCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager`` writing and reading UCP (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        """``CheckpointManager.Config``; building it makes a :class:`UCPCheckpointManager`."""

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """Save ``state_dict`` as the UCP checkpoint ``checkpoint_id`` (sync or async)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        _refuse_bytes({k: v.state_dict() if hasattr(v, "state_dict") else v
                       for k, v in state_dict.items() if k != OPTIMIZER})
        # async: the cells move over the manager's own group, as DCP's collectives do,
        # while training goes on over the default one
        writer = UCPWriter(checkpoint_id, overwrite=True, key_map=KeyMap.torchtitan(),
                           process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            raise InvalidValueError("async_with_pinned_mem is not supported by "
                                    "UCPCheckpointManager; use async", path="async_mode")
        if async_mode == AsyncMode.ASYNC:
            return async_save(state_dict, storage_writer=writer, process_group=self.pg)
        save(state_dict, storage_writer=writer)
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """Load the UCP checkpoint ``checkpoint_id`` into ``state_dict``."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        try:
            dcp_load_state(state_dict,
                     storage_reader=UCPReader(checkpoint_id, key_map=KeyMap.torchtitan()))
        except CheckpointException as exc:  # DCP's planner refused (a BaseException)
            raise LoadError(f"the checkpoint does not fit the state to load: {exc}",
                            path=checkpoint_id) from exc
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest ``step-<N>`` folder holding a committed UCP checkpoint (its root
        ``zarr.json``, written last), or DCP's ``.metadata``; -1 if none."""
        folder = folder or self.folder
        if not os.path.isdir(folder):
            return -1
        steps = [int(m.group(1)) for name in os.listdir(folder)
                 if (m := _STEP.fullmatch(name))
                 and (os.path.isfile(os.path.join(folder, name, "zarr.json"))
                      or os.path.isfile(os.path.join(folder, name, ".metadata")))]
        return max(steps, default=-1)

    def _purge_stale_checkpoints(self) -> None:
        """Rank 0 deletes all but the newest ``keep_latest_k`` step folders."""
        if not (self.keep_latest_k > 0 and (not dist.is_initialized() or dist.get_rank() == 0)
                and os.path.isdir(self.folder)):
            return
        found = sorted((int(m.group(1)), os.path.join(self.folder, name))
                       for name in os.listdir(self.folder) if (m := _STEP.fullmatch(name)))
        for _, path in found[: -self.keep_latest_k]:
            remove(path)


__all__ = ["TESTED", "UCPCheckpointManager"]
