"""Runs of the Trainer-checkpoint conversion tests: ``python -m
tests.trainers.hf_convert_worker <scenario>:<name>[:<checkpoint>],... <root>`` (run by
tests/trainers/test_hf_convert.py on 1 or 2 gloo processes; the runs one after the
other in one process).

A tiny GPT-2 (dropout on) trains on 32 shuffled sequences for 12 steps, saving every 3:
``stock`` with the stock ``transformers.Trainer`` into ``<root>/<name>``; ``resume``
with ``UCPTrainer`` from the UCP checkpoint ``<checkpoint>``, into ``<root>/<name>``.
Each rank writes its losses, and its parameters and optimizer state (``exp_avg``) at
the start of training (after the resume loaded them) and at the end, to
``<root>/<name>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging  # noqa: E402

from tests.trainers.launch import finish  # noqa: E402
from ucpformat.trainers.transformers import UCPTrainer  # noqa: E402

logging.set_verbosity_error()
STEPS = 12


def model() -> GPT2LMHeadModel:
    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids}
            for _ in range(32)]


def state(trainer: Trainer) -> dict[str, Any]:
    """The model's tensors and the optimizer's ``exp_avg`` by parameter name."""
    opt = trainer.optimizer
    return {"params": {k: v.tolist() for k, v in trainer.model.state_dict().items()},
            "exp_avg": {n: opt.state[p]["exp_avg"].tolist()
                        for n, p in trainer.model.named_parameters() if p in opt.state}}


class AtBegin(TrainerCallback):  # type: ignore[misc]
    """Records the state the Trainer starts from (after a resume has loaded it)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.trainer.begin = state(self.trainer)


class Recording:
    losses: list[float]

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        value = loss[0] if isinstance(loss, tuple) else loss
        self.losses.append(float(value.detach()))
        return loss


class Stock(Recording, Trainer):  # type: ignore[misc]
    pass


class UCP(Recording, UCPTrainer):
    pass


def make(cls: type[Trainer], out: Path) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS,
        learning_rate=0.01, weight_decay=0.1, warmup_steps=2, save_strategy="steps",
        save_steps=3, logging_steps=1, report_to=[], use_cpu=True, seed=7,
        dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo")
    trainer = cls(model=model(), args=args, train_dataset=dataset())
    trainer.losses = []
    trainer.add_callback(AtBegin(trainer))
    return trainer


def run(scenario: str, root: Path, name: str, checkpoint: str | None) -> None:
    trainer = make(Stock if scenario == "stock" else UCP, root / name)
    if scenario == "stock":
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=checkpoint)
    (root / f"{name}-{os.environ.get('RANK', '0')}.json").write_text(json.dumps({
        "losses": trainer.losses, "step": trainer.state.global_step,
        "begin": trainer.begin, **state(trainer)}))


def main() -> None:
    root = Path(sys.argv[2])
    code = 0
    try:
        for spec in sys.argv[1].split(","):
            scenario, name, *checkpoint = spec.split(":")
            run(scenario, root, name, checkpoint[0] if checkpoint else None)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    main()
