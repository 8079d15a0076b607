"""The Hugging Face ``Trainer`` saves and resumes UCP checkpoints.

Use :class:`UCPTrainer` where ``Trainer`` was; nothing else changes::

    trainer = UCPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()                                   # saves output_dir/checkpoint-<step>
    trainer.train(resume_from_checkpoint=True)        # or a checkpoint-<step> path

Each ``checkpoint-<step>`` directory is one UCP checkpoint, written by every process
together (:func:`ucpformat.torch.save_distributed`): ``model/<fqn>``, ``optimizer/`` by
parameter name, ``training/scheduler``, ``training/step`` (the global step),
``training/trainer_state`` (what the stock Trainer writes to ``trainer_state.json``,
rank 0's view: log history, best metric, stateful callbacks, as tagged JSON of
:mod:`ucpformat.trainers.common`; no ``trainer_state.json`` beside it) and
``training/ranks/<rank>/rng`` (each process's generators, UCP-1.0-R086). Nothing is pickled:
``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` and ``training_args.bin`` are not
written. ``save_total_limit`` deletes old checkpoints the way UCP deletes
(:func:`ucpformat.trainers.common.remove`). Resuming checks the model against the
checkpoint first (a checkpoint of another model is refused naming the tensor, before the
Trainer's state is touched), then restores the optimizer, scheduler, trainer state and
generators where the stock Trainer restores its files.

Not supported: a gradient scaler (``fp16`` on a GPU) is not stored;
``load_best_model_at_end`` and DeepSpeed are refused when the trainer is made.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ucpformat.errors import InvalidValueError, KeyMismatchError
from ucpformat.optional import require
from ucpformat.trainers.common import (
    check_version,
    decode_state,
    encode_state,
    gathered_rng,
    rank0_view,
    rank_rng_extra,
    remove,
    restore_rng,
)

transformers = require("transformers", extra="transformers",
                       purpose="ucpformat.trainers.transformers")
from transformers import Trainer, TrainerState  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import (  # noqa: E402
    PREFIX_CHECKPOINT_DIR,
    compare_trainer_and_checkpoint_args,
    get_last_checkpoint,
    sort_checkpoints,
)

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402

#: The transformers versions (major.minor, first and last) :class:`UCPTrainer` was tested with.
TESTED = ((5, 24), (5, 24))
check_version("transformers", transformers.__version__, TESTED)


def _inner(obj: Any, attribute: str) -> Any:
    """The optimizer or scheduler inside Accelerate's wrapper."""
    return getattr(obj, attribute, obj) if obj is not None else None


class UCPTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` whose checkpoints are UCP (see the module docstring)."""

    _ucp_resume: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise InvalidValueError(
                "UCPTrainer does not load the best model at the end (load it with "
                "ucpformat.torch's load from state.best_model_checkpoint)",
                path="TrainingArguments.load_best_model_at_end")
        if self.is_deepspeed_enabled:
            raise InvalidValueError("UCPTrainer does not save DeepSpeed engines (see "
                                    "ucpformat.deepspeed)", path="TrainingArguments.deepspeed")

    # -- saving ---------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Every process: write ``checkpoint-<step>`` as one UCP checkpoint."""
        output_dir = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if self.state.best_global_step:
            best = os.path.join(self._get_output_dir(trial=trial),
                                f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        whole = not self.args.save_only_model
        extra: dict[str, Any] = {"trainer_state": rank0_view(encode_state(
            dataclasses.asdict(self.state), where="training/trainer_state"))}
        if whole:
            extra.update(rank_rng_extra(gathered_rng()))
        ucpt.save_distributed(
            output_dir, model=self.model,
            optimizer=_inner(self.optimizer, "optimizer") if whole else None,
            scheduler=_inner(self.lr_scheduler, "scheduler") if whole else None,
            step=self.state.global_step, extra=extra,
            metadata={"trainer": f"transformers {transformers.__version__}"}, overwrite=True)
        if self.args.should_save:
            self._rotate_ucp_checkpoints(self._get_output_dir(trial=trial))

    def _rotate_ucp_checkpoints(self, run_dir: str) -> None:
        """``save_total_limit``: the oldest checkpoints go, never the newest or the best."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=False)
        protected = {checkpoints[-1]} if checkpoints else set()
        if self.state.best_model_checkpoint:
            protected.add(str(self.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if checkpoint not in protected:
                remove(checkpoint)
                remaining -= 1

    # -- resuming -------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from a UCP ``checkpoint-<step>`` (``True``: the
        last one in ``output_dir``). The model is loaded, checked first, before any of
        the Trainer's state."""
        path: str | None
        if resume_from_checkpoint is True:
            path = get_last_checkpoint(self.args.output_dir)
            if path is None:
                raise KeyMismatchError("no checkpoint-<step> directory to resume from",
                                       path=str(self.args.output_dir))
        elif resume_from_checkpoint:
            path = os.fspath(resume_from_checkpoint)
        else:
            path = None
        if path is not None:
            self._load_from_checkpoint(path)
        self._ucp_resume = path
        try:
            return super().train(resume_from_checkpoint=None, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._ucp_resume = None

    def _inner_training_loop(self, batch_size: int | None = None, args: Any = None,
                             resume_from_checkpoint: str | None = None, trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> Any:
        return super()._inner_training_loop(
            batch_size=batch_size, args=args,
            resume_from_checkpoint=self._ucp_resume or resume_from_checkpoint, trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The model from the UCP checkpoint (every process; names, shapes and values
        checked before any tensor changes)."""
        ucpt.load_distributed(resume_from_checkpoint,
                              model=model if model is not None else self.model)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int,
                             num_train_epochs: int, resume_from_checkpoint: str | None,
                             trial: Any) -> tuple[int, int]:
        found = super()._init_training_state(max_steps, num_update_steps_per_epoch,
                                             num_train_epochs, None, trial)
        if resume_from_checkpoint is None:
            return tuple(found)  # type: ignore[return-value]
        with ucpformat.open(resume_from_checkpoint) as ckpt:
            training = ckpt.to_dict("training") if "training" in ckpt.groups else {}
        if "trainer_state" not in training:
            raise KeyMismatchError("not a checkpoint of UCPTrainer: no training/trainer_state",
                                   path=resume_from_checkpoint)
        stored = decode_state(training["trainer_state"],
                              where=f"{resume_from_checkpoint}: training/trainer_state")
        self.state = TrainerState(**stored)
        best = self.state.best_model_checkpoint
        if best is not None and not os.path.isdir(best):
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps = 0
        if not self.args.ignore_data_skip:
            steps = (self.state.global_step % num_update_steps_per_epoch
                     ) * self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer (by parameter name) and scheduler, with the model again (every
        process; all checked first)."""
        if checkpoint is None:
            return
        ucpt.load_distributed(checkpoint, model=self.model,
                              optimizer=_inner(self.optimizer, "optimizer"),
                              scheduler=_inner(self.lr_scheduler, "scheduler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """This process's generators from ``training/ranks/<process index>/rng``."""
        if checkpoint is None:
            return
        restore_rng(checkpoint, self.args.process_index, self.args.world_size)


__all__ = ["TESTED", "UCPTrainer"]
