"""PyTorch Lightning saves and resumes UCP checkpoints.

Single device and DDP: one callback, which installs :class:`UCPCheckpointIO` as the
strategy's ``CheckpointIO`` and records every rank's generators with each checkpoint::

    trainer = L.Trainer(callbacks=[UCPCheckpointing(), ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="checkpoints/last.ckpt")   # resumes from UCP

FSDP2 / tensor parallel: the strategy, whose distributed checkpoints are UCP (every rank
writes its shards through :func:`ucpformat.torch.save_distributed`)::

    trainer = L.Trainer(strategy=UCPModelParallelStrategy(data_parallel_size=2), ...)

Either writes one UCP checkpoint (a directory, ``.ckpt`` name and all) holding
``model/<fqn>``, ``optimizer/`` by parameter name (one optimizer), ``training/step``
(the global step), ``training/lightning`` (the rest of Lightning's checkpoint dict:
epoch, loops, callbacks such as ``ModelCheckpoint``'s top-k, LR schedulers,
hyper-parameters, as tagged JSON: :mod:`ucpformat.trainers.common`) and
``training/ranks/<rank>/rng`` (each rank's generators, UCP-1.0-R086: Lightning stores none). The two
kinds of checkpoint have the same layout, so one saved by either loads into the other,
on any number of ranks. ``ModelCheckpoint``'s top-k, ``last.ckpt`` and the removal of
old checkpoints work through ``remove_checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ucpformat.errors import (
    InvalidValueError,
    KeyMismatchError,
    ShapeMismatchError,
)
from ucpformat.optional import require
from ucpformat.trainers.common import (
    check_version,
    decode_state,
    encode_state,
    gathered_rng,
    rank_rng_extra,
    remove,
    restore_rng,
)

L = require("lightning", extra="lightning", purpose="ucpformat.trainers.lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402

#: The Lightning versions (major.minor, first and last) these classes were tested with.
TESTED = ((2, 6), (2, 6))
#: Where the callback leaves every rank's generators in Lightning's checkpoint dict.
RNG_KEY = "ucpformat_rank_rng"
_OWN = ("state_dict", "optimizer_states", RNG_KEY)

check_version("lightning", L.__version__, TESTED)


def _one_optimizer(optimizers: list[Any]) -> torch.optim.Optimizer | None:
    if len(optimizers) > 1:
        raise InvalidValueError(
            f"the module has {len(optimizers)} optimizers; ucpformat's Lightning integration "
            "saves one", path="optimizer_states")
    if not optimizers:
        return None
    opt = optimizers[0]
    inner = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
    assert isinstance(inner, torch.optim.Optimizer)
    return inner


def _trainer_state(checkpoint: Mapping[str, Any]) -> list[Any]:
    return encode_state({k: v for k, v in checkpoint.items() if k not in _OWN},
                        where="training/lightning")


def _stored_state(training: Mapping[str, Any], path: str) -> dict[str, Any]:
    if "lightning" not in training:
        raise KeyMismatchError("not a checkpoint of ucpformat's Lightning integration: no "
                               "training/lightning", path=path)
    return decode_state(training["lightning"], where=f"{path}: training/lightning")


class UCPCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Lightning's ``CheckpointIO`` writing and reading UCP (single device, DDP).

    Installed by :class:`UCPCheckpointing` (it needs the trainer: Lightning hands a
    ``CheckpointIO`` optimizer state keyed by integer ids, which the module names). Rank
    0 writes; every rank reads. Loading checks the checkpoint against the module (names,
    shapes, types: a checkpoint of another model is refused naming the tensor) and loads
    it before Lightning restores anything else.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) as a UCP checkpoint at ``path``."""
        if storage_options is not None:
            raise InvalidValueError("UCPCheckpointIO takes no storage_options", path=str(path))
        module = self.trainer.lightning_module
        optimizer = (_one_optimizer(self.trainer.optimizers)
                     if "optimizer_states" in checkpoint else None)
        rng = checkpoint.get(RNG_KEY) or gathered_rng()
        ucpt.save(os.fspath(path), model=module, optimizer=optimizer,
                  step=int(checkpoint.get("global_step", 0)),
                  extra={"lightning": _trainer_state(checkpoint), **rank_rng_extra(rng)},
                  metadata={"trainer": f"lightning {L.__version__}"}, overwrite=True)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the module from ``path`` (checked first) and give Lightning the rest."""
        path = os.fspath(path)
        module = self.trainer.lightning_module
        optimizer_state = None
        with ucpformat.open(path) as ckpt:
            # the model first, all checked before any tensor changes: a checkpoint of
            # another model is refused naming its tensor
            result = ucpt.load(ckpt, model=module, strict=module.strict_loading)
            if "optimizer" in ckpt.groups:
                optimizer_state = _optimizer_by_id(ckpt, module)
        state = _stored_state(result.training, path)
        state["state_dict"] = module.state_dict()
        if optimizer_state is not None:
            state["optimizer_states"] = [optimizer_state]
        restore_rng(result.training, self.trainer.global_rank, self.trainer.world_size)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the UCP checkpoint at ``path``."""
        remove(path)


def _optimizer_by_id(ckpt: Any, module: torch.nn.Module) -> dict[str, Any]:
    """The stored optimizer state keyed by torch's integer ids, numbered in the stored
    param groups' order (as ``Optimizer.load_state_dict`` matches them); each stored
    parameter name must be a parameter of ``module`` of the stored state's shape."""
    stored = ucpt.read_optimizer_state(ckpt)
    params = dict(module.named_parameters())
    for fqn, entries in stored["state"].items():
        param = params.get(fqn)
        if param is None:
            raise KeyMismatchError("the checkpoint's optimizer holds state for a parameter "
                                   "the module lacks", tensor=f"optimizer/state/{fqn}")
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape != param.shape:
                raise ShapeMismatchError(
                    f"stored shape {list(value.shape)}, the module's parameter has "
                    f"{list(param.shape)}", tensor=f"optimizer/state/{fqn}/{name}")
    ids: dict[str, int] = {}
    groups = []
    for group in stored["param_groups"]:
        numbered = []
        for fqn in group["params"]:
            ids.setdefault(fqn, len(ids))
            numbered.append(ids[fqn])
        groups.append({**group, "params": numbered})
    return {"state": {ids[fqn]: entries for fqn, entries in stored["state"].items()},
            "param_groups": groups}


class UCPCheckpointing(Callback):  # type: ignore[misc]
    """Lightning saves and resumes UCP: installs :class:`UCPCheckpointIO` (single device,
    DDP) and records every rank's generators in each checkpoint (with
    :class:`UCPModelParallelStrategy` too)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Install the ``CheckpointIO`` (refusing a strategy that bypasses it)."""
        strategy = trainer.strategy
        if isinstance(strategy, UCPModelParallelStrategy):
            return
        if isinstance(strategy, ModelParallelStrategy):
            raise InvalidValueError(
                "ModelParallelStrategy writes its distributed checkpoints without the "
                "CheckpointIO: use ucpformat.trainers.lightning.UCPModelParallelStrategy",
                path="strategy")
        strategy.checkpoint_io = UCPCheckpointIO(trainer)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        """Every rank's generators, gathered (every rank calls this)."""
        checkpoint[RNG_KEY] = gathered_rng()


class UCPModelParallelStrategy(ModelParallelStrategy):  # type: ignore[misc]
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) whose checkpoints
    are UCP, saved and loaded collectively by every rank
    (:func:`ucpformat.torch.save_distributed` / ``load_distributed``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_distributed_checkpoint", True)
        if not kwargs["save_distributed_checkpoint"]:
            raise InvalidValueError("UCPModelParallelStrategy saves distributed checkpoints "
                                    "(save_distributed_checkpoint=True)",
                                    path="save_distributed_checkpoint")
        super().__init__(*args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Every rank: save the model, optimizer and Lightning's state to ``filepath``."""
        if storage_options is not None:
            raise InvalidValueError("UCPModelParallelStrategy takes no storage_options",
                                    path=str(filepath))
        path = str(self.broadcast(os.fspath(filepath)))
        optimizer = (_one_optimizer(self.optimizers)
                     if "optimizer_states" in checkpoint else None)
        rng = checkpoint.get(RNG_KEY) or gathered_rng()
        # rank 0's view of the loops and callbacks, as Lightning's own strategies write
        # (a metric logged without sync_dist differs between ranks)
        trainer_state = self.broadcast(_trainer_state(checkpoint))
        ucpt.save_distributed(
            path, model=self.model, optimizer=optimizer,
            step=int(checkpoint.get("global_step", 0)),
            extra={"lightning": trainer_state, **rank_rng_extra(rng)},
            metadata={"trainer": f"lightning {L.__version__}"}, overwrite=True)

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank: load the model and optimizer (checked on every rank first) and give
        Lightning the rest."""
        path = str(self.broadcast(os.fspath(checkpoint_path)))
        assert self.lightning_module is not None
        optimizer = _one_optimizer(self.optimizers)
        result = ucpt.load_distributed(path, model=self.model, optimizer=optimizer,
                                       strict=self.lightning_module.strict_loading)
        state = _stored_state(result.training, path)
        restore_rng(path, self.global_rank, self.world_size)  # this rank's group only
        return state

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 deletes the UCP checkpoint at ``filepath``."""
        if self.is_global_zero:
            remove(filepath)


__all__ = ["RNG_KEY", "TESTED", "UCPCheckpointIO", "UCPCheckpointing",
           "UCPModelParallelStrategy"]
