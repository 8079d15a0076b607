"""Accelerate's ``save_state`` / ``load_state`` write and read UCP checkpoints.

Use :class:`UCPAccelerator` where ``Accelerator`` was; ``save_state`` and ``load_state``
keep their signatures (``automatic_checkpoint_naming`` and ``total_limit`` included)::

    accelerator = UCPAccelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, sched)
    accelerator.save_state("ckpt/epoch-2")      # every process calls it
    accelerator.load_state("ckpt/epoch-2")      # on any number of processes

One UCP checkpoint, written by every process together
(:func:`ucpformat.torch.save_distributed`): ``model/<fqn>`` (a DDP, FSDP2 or plain
model, unwrapped), ``optimizer/`` by parameter name, ``training/scheduler``,
``training/step`` (``accelerator.step``), ``training/accelerate`` (the checkpoint
iteration and the ``state_dict()`` of every object registered with
``register_for_checkpointing``, tagged JSON of :mod:`ucpformat.trainers.common`),
``training/dataloaders/<i>/generator`` (the generator Accelerate shuffles each prepared
loader with and synchronises across processes: Accelerate itself does not store it) and
``training/ranks/<rank>/rng`` (each process's generators, UCP-1.0-R086). No pickle.

One model, one optimizer and at most one scheduler are saved (more are refused, named).
An FSDP2 model made with ``fully_shard`` is saved sharded as it is; on CPU, Accelerate
ignores its own FSDP plugin (``MULTI_CPU``), so give it such a model through
``prepare_model(model, evaluation_mode=True)``. DeepSpeed and Megatron-LM engines are
refused (see :mod:`ucpformat.deepspeed`, :mod:`ucpformat.megatron`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ucpformat.checkpoint import rank_state
from ucpformat.errors import InvalidValueError, KeyMismatchError
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

accelerate = require("accelerate", extra="accelerate", purpose="ucpformat.trainers.accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402

#: The Accelerate versions (major.minor, first and last) :class:`UCPAccelerator` was tested with.
TESTED = ((1, 15), (1, 15))
check_version("accelerate", accelerate.__version__, TESTED)
_NUMBERED = re.compile(r"([0-9]+)(?=[^/]*$)")


def _one(objects: list[Any], what: str, attribute: str) -> Any:
    if len(objects) > 1:
        raise InvalidValueError(f"{len(objects)} {what}s are prepared; UCPAccelerator saves "
                                f"one", path=f"accelerator.{what}s")
    if not objects:
        return None
    return getattr(objects[0], attribute, objects[0])


def _number(folder: str) -> int:
    found = _NUMBERED.findall(folder)
    return int(found[0]) if found else -1


class UCPAccelerator(Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose ``save_state`` / ``load_state`` are UCP (see the
    module docstring)."""

    def _objects(self) -> tuple[torch.nn.Module, Any, Any]:
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise InvalidValueError(f"UCPAccelerator does not save {self.distributed_type} "
                                    "engines", path="accelerator.distributed_type")
        if len(self._models) != 1:
            raise InvalidValueError(f"{len(self._models)} models are prepared; UCPAccelerator "
                                    "saves one", path="accelerator.models")
        model = self.unwrap_model(self._models[0], keep_torch_compile=False)
        return (model, _one(self._optimizers, "optimizer", "optimizer"),
                _one(self._schedulers, "scheduler", "scheduler"))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Every process: save the prepared model, optimizer, scheduler, registered
        objects, loader generators and every process's generators as one UCP checkpoint;
        returns its path."""
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            base = os.path.join(self.project_dir, "checkpoints")
            os.makedirs(base, exist_ok=True)
            folders = sorted((os.path.join(base, f) for f in os.listdir(base)), key=_number)
            if (config.total_limit is not None and len(folders) + 1 > config.total_limit
                    and self.is_main_process):
                for folder in folders[: len(folders) + 1 - config.total_limit]:
                    remove(folder)
            output_dir = os.path.join(base, f"checkpoint_{self.save_iteration}")
            self.wait_for_everyone()
        elif output_dir is None:
            raise InvalidValueError("no output_dir, and automatic_checkpoint_naming is off",
                                    path="output_dir")
        output_dir = os.path.expanduser(os.fspath(output_dir))
        model, optimizer, scheduler = self._objects()
        own = {"iteration": config.iteration + 1,
               "custom": [obj.state_dict() for obj in self._custom_objects]}
        loaders = {str(i): {"generator": dl.synchronized_generator.get_state()}
                   for i, dl in enumerate(self._dataloaders)
                   if getattr(dl, "synchronized_generator", None) is not None}
        extra: dict[str, Any] = {"accelerate": encode_state(own, where="training/accelerate"),
                                 **rank_rng_extra(gathered_rng())}
        if loaders:
            extra["dataloaders"] = loaders
        ucpt.save_distributed(output_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                              step=self.step, extra=extra,
                              metadata={"trainer": f"accelerate {accelerate.__version__}"},
                              overwrite=True)
        config.iteration += 1
        return output_dir

    def load_state(self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Every process: load a UCP checkpoint saved on any number of processes; the
        model, optimizer and scheduler are checked against it (another model is refused
        naming the tensor) before anything changes."""
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise InvalidValueError("no input_dir, and automatic_checkpoint_naming is off",
                                        path="input_dir")
            base = os.path.join(self.project_dir, "checkpoints")
            folders = sorted((os.path.join(base, f) for f in os.listdir(base)), key=_number)
            if not folders:
                raise KeyMismatchError("no checkpoint to load", path=base)
            input_dir = folders[-1]
        path = os.path.expanduser(os.fspath(input_dir))
        model, optimizer, scheduler = self._objects()
        with ucpformat.open(path) as ckpt:
            training = (ckpt.to_dict("training", exclude=(rank_state.GROUP,))
                        if "training" in ckpt.groups else {})
            if "accelerate" not in training:
                raise KeyMismatchError("not a checkpoint of UCPAccelerator: no "
                                       "training/accelerate", path=path)
            own = decode_state(training["accelerate"], where=f"{path}: training/accelerate")
            custom = own.get("custom", [])
            if len(custom) != len(self._custom_objects):
                raise KeyMismatchError(
                    f"the checkpoint holds {len(custom)} registered objects, "
                    f"{len(self._custom_objects)} are registered", path=f"{path}: "
                    "training/accelerate")
            ucpt.load_distributed(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
        for obj, state in zip(self._custom_objects, custom, strict=True):
            obj.load_state_dict(state)
        loaders = training.get("dataloaders", {})
        for i, dl in enumerate(self._dataloaders):
            generator = getattr(dl, "synchronized_generator", None)
            stored = loaders.get(str(i), {}).get("generator")
            if generator is not None and stored is not None:
                generator.set_state(torch.as_tensor(stored).to(torch.uint8))
        self.step = int(training.get("step", 0))
        self.project_configuration.iteration = int(own.get("iteration", 0))
        restore_rng(path, self.process_index, self.num_processes)  # this rank's group only


__all__ = ["TESTED", "UCPAccelerator"]
